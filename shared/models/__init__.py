"""The packaged models both sides load by default, by name, and where their converted folders
live. Fetching and converting them is shared/models/store.py (`specedge-models fetch`)."""

from __future__ import annotations

import os
from pathlib import Path

DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"
TARGET_MODEL = "qwen2.5-coder-1.5b-instruct"


def default_cache_dir() -> Path:
    """Where converted models live: a user cache, never the repo (they are GBs).

    ``$SPECEDGE_CACHE_DIR`` wins, then ``$XDG_CACHE_HOME/specedge/models``,
    then ``~/.cache/specedge/models``.
    """
    explicit = os.environ.get("SPECEDGE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specedge" / "models"
