"""Where alpacafarm keeps shared state (converted models, annotation cache): never inside the package."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "ALPACAFARM_CACHE_DIR"


def cache_dir() -> Path:
    """``$ALPACAFARM_CACHE_DIR``, else ``$XDG_CACHE_HOME/alpacafarm``, else ``~/.cache/alpacafarm``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        path = Path(explicit).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "alpacafarm"
    path.mkdir(parents=True, exist_ok=True)
    return path
