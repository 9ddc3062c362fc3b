"""``python -m ntkscope``: the ntkscope command."""

import sys

from ntkscope.app.cli import main

sys.exit(main())
