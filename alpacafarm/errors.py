"""Exceptions the CLI turns into one clear line and exit status 2 (no traceback unless ``--debug``)."""

from __future__ import annotations


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
