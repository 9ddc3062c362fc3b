"""The numbers README.md and docs/ quote, rendered from the committed runs: documentation tooling,
not part of the installed packages (``python scripts/render_claims.py README.md docs/*.md``;
``tests/test_claims.py`` checks every quoted number against them)."""
