"""A Griffe extension for the API pages: alpacafarm's docstrings are reStructuredText prose, shown as Markdown.

mkdocstrings renders docstrings as Markdown. Without this, Sphinx roles show literally (``:class:`Register```
as ":class:Register") and version notes as a paragraph starting with "..". This rewrites, in every docstring
it loads (the source files are not touched):

- ``:class:`X``` (any role: ``func``, ``meth``, ``mod``, ``data``, ``attr``, ...) → ```X```, and
  ``:class:`~a.b.X``` → ```X``` (Sphinx's ``~`` shows the last component);
- ``.. versionadded:: V`` / ``.. versionchanged:: V`` with their indented text → "*Added in V.* text";
- a definition list (a term line, then its indented definition) → a bulleted "**term**: definition" list;
- a paragraph ending in ``::`` (a literal block follows) → ``:``; the indented block is already Markdown code.

Used by mkdocs.yml (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?[a-z]+:`~?(?:[\w.]*\.)?([^`]+)`")
ROLE_FULL = re.compile(r":(?:py:)?[a-z]+:`([^~`][^`]*)`")
VERSION = re.compile(r"^(\s*)\.\. version(added|changed|deprecated):: *(\S+) *(.*)$")
LABELS = {"added": "Added in", "changed": "Changed in", "deprecated": "Deprecated since"}


def roles_to_code(text: str) -> str:
    """Sphinx roles → Markdown code spans (``~`` keeps only the last dotted component)."""
    text = ROLE_FULL.sub(lambda m: f"`{m.group(1)}`", text)
    return ROLE.sub(lambda m: f"`{m.group(1)}`", text)


def version_notes(text: str) -> str:
    """``.. versionadded:: V`` and its indented continuation → one Markdown paragraph."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = VERSION.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent, kind, version, rest = match.groups()
        body = [rest] if rest else []
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            body.append(lines[i].strip())
            i += 1
        label = f"*{LABELS[kind]} {version}{':' if body else '.'}*"
        out.append(" ".join([indent + label, *body]))
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def definition_lists(text: str) -> str:
    """RST definition lists (a term at the margin, its definition indented below it) → Markdown bullets."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        starts_block = i == 0 or not lines[i - 1].strip() or _indent(lines[i - 1]) > 0
        is_term = (line.strip() and _indent(line) == 0 and not line.startswith(("- ", "* ", ".."))
                   and not line.endswith("::") and i + 1 < len(lines) and lines[i + 1].strip()
                   and _indent(lines[i + 1]) > 0)
        if not (is_term and starts_block):
            out.append(line)
            i += 1
            continue
        if out and out[-1].strip() and not out[-1].startswith("- **"):
            out.append("")
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > 0:
            body.append(lines[i].strip())
            i += 1
        out.append(f"- **{line.strip()}**: " + " ".join(body))
        if i < len(lines) and lines[i].strip() and _indent(lines[i]) == 0 and not (
                i + 1 < len(lines) and lines[i + 1].strip() and _indent(lines[i + 1]) > 0):
            out.append("")
    return "\n".join(out)


def literal_markers(text: str) -> str:
    """RST's ``text::`` (a literal block follows) → ``text:``."""
    return re.sub(r"(?<=\S)::$", ":", text, flags=re.M)


class SphinxRoles(Extension):
    """Rewrite reStructuredText bits of every loaded docstring into Markdown."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = version_notes(roles_to_code(obj.docstring.value))
            obj.docstring.value = literal_markers(definition_lists(text))
