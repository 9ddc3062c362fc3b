"""Render the quoted numbers of Markdown files from the committed runs (scripts/doc_claims):

    python scripts/render_claims.py [--root DIR] README.md docs/*.md
"""

import sys

from doc_claims.claims import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
