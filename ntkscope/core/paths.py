"""Where ntkscope looks for files it does not ship."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """Where downloaded source files (the ScanCode wheel, GO.db, GPT-2's BPE ranks) are looked for:
    ``$NTKSCOPE_SOURCES``, else ``~/.cache/ntkscope/sources``."""
    return Path(os.environ.get("NTKSCOPE_SOURCES", Path.home() / ".cache" / "ntkscope" / "sources"))


def user_cache_dir() -> Path:
    """Where ntkscope caches what it computed about inputs it may not write into: ``$NTKSCOPE_CACHE``,
    else ``~/.cache/ntkscope``."""
    return Path(os.environ.get("NTKSCOPE_CACHE", Path.home() / ".cache" / "ntkscope"))
