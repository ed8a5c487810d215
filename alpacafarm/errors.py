"""Exceptions the CLI turns into one clear line and exit status 2 (no traceback unless ``--debug``)."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Something the user can fix: a bad recipe, an unknown name, a missing file or package.

    The message must name the culprit (file and YAML path, plugin, name) in one line.
    """

    exit_code = 2


class RecipeError(UserError):
    """A recipe that does not parse or does not validate."""


class UnknownNameError(UserError):
    """A method, annotator, evaluator, ... name that no plugin registered."""


class PluginError(UserError):
    """A plugin that cannot be loaded or that conflicts with another plugin."""


class MissingPackageError(UserError):
    """An optional package is needed; the message carries the exact ``pip install`` command."""


def did_you_mean(name: str, choices: list[str]) -> str:
    """A suffix such as ``"; did you mean 'offline'?"`` (empty when nothing is close)."""
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.6)
    if not close:
        return ""
    # Only the near-best: 'split_instruction' suggests 'split_instructions', not also 'expert_iteration'.
    best = difflib.SequenceMatcher(None, name, close[0]).ratio()
    close = [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() >= best - 0.05]
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
