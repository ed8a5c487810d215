"""The plugin contract itself (``alpacafarm/hookspecs.py``): what it says is true, and nothing is left unsaid."""

from __future__ import annotations

import re

from conftest import REPO_ROOT
from packaging.version import Version

from alpacafarm import hookspecs


def test_every_version_note_names_a_version_the_package_has_reached():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    package = Version(re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1))
    source = (REPO_ROOT / "alpacafarm" / "hookspecs.py").read_text(encoding="utf-8")
    notes = re.findall(r"\.\. version(added|changed):: (\S+)", source)
    assert notes, "the hookspecs carry no version notes"
    assert [(what, v) for what, v in notes if Version(v) > package] == []
    hooks = [name for name in dir(hookspecs) if name.startswith("register_")]
    for hook in hooks:  # each hook says when it appeared
        assert ".. versionadded::" in getattr(hookspecs, hook).__doc__, hook
