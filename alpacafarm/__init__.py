"""alpacafarm: simulate pairwise human feedback, learn from it, evaluate by win-rate.

Importing this package is cheap on purpose (no torch, trl or pydantic): the CLI's ``--help`` and the plugin
loader import it first. Heavy pieces live in submodules that are imported where they are used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pluggy

try:
    __version__ = version("alpacafarm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

PROJECT_NAME = "alpacafarm"

#: Marks a function as a hook specification (used only by :mod:`alpacafarm.hookspecs`).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a plugin's function as the implementation of a hook, e.g. ``@alpacafarm.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "__version__", "hookimpl", "hookspec"]
