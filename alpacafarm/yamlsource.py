"""YAML documents that remember where each key came from, with ``include:`` and ``--set`` overrides.

Recipes are loaded with PyYAML's safe loader only (no tags that run code). Every mapping key and list item
gets a position ``(file, line)`` so a validation error can say ``recipes/x.yaml:12: stages[0].config.lr: ...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from alpacafarm.errors import REDACTED, RecipeError, did_you_mean, looks_like_secret, shown_value
from alpacafarm.paths import read_text

Path_ = tuple[str | int, ...]


def format_path(path: Path_) -> str:
    """``("stages", 0, "config", "lr")`` → ``"stages[0].config.lr"``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


@dataclass
class SourcedDocument:
    """A plain YAML value plus the source position of every path in it."""

    data: Any
    positions: dict[Path_, tuple[str, int]] = field(default_factory=dict)

    def where(self, path: Path_) -> str:
        """``"file:line"`` of the longest known prefix of ``path`` (empty when unknown)."""
        for end in range(len(path), -1, -1):
            pos = self.positions.get(tuple(path[:end]))
            if pos is not None:
                return pos[0] if pos[0] == "--set" else f"{pos[0]}:{pos[1]}"
        return ""

    def error(self, path: Path_, message: str) -> RecipeError:
        where = self.where(path)
        prefix = f"{where}: " if where else ""
        return RecipeError(f"{prefix}{format_path(path)}: {message}")


#: At most this many values once aliases are expanded: a recipe has hundreds; nested aliases ("billion laughs")
#: would expand a few hundred bytes into billions of values.
MAX_VALUES = 100_000


@dataclass
class _Budget:
    """What :func:`_build` has expanded so far: a count, and the collections being built (to catch an alias that
    refers to a collection containing it)."""

    source: str
    count: int = 0
    active: set[int] = field(default_factory=set)

    def spend(self, node: yaml.Node, path: Path_) -> None:
        self.count += 1
        if self.count > MAX_VALUES:
            raise RecipeError(f"{self.source}: more than {MAX_VALUES:,} values once YAML aliases are expanded "
                              "(nested aliases?); write the values out instead")
        if id(node) in self.active:
            raise RecipeError(f"{self.source}:{node.start_mark.line + 1}: {format_path(path)}: a YAML alias refers "
                              "to a collection that contains it (a recursive alias)")


def _build(node: yaml.Node, path: Path_, positions: dict, source: str, budget: _Budget | None = None) -> Any:
    budget = budget or _Budget(source)
    budget.spend(node, path)
    positions.setdefault(path, (source, node.start_mark.line + 1))
    if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        budget.active.add(id(node))
        try:
            return _build_collection(node, path, positions, source, budget)
        finally:
            budget.active.discard(id(node))
    # Scalars: the safe constructor resolves ints, floats, bools, nulls exactly as safe_load would (an empty
    # value, as in ``config:`` with nothing after it, is null).
    value = _construct(node)
    return _fix_exponent_float(value) if getattr(node, "style", None) is None else value  # quoted stays text


def _build_collection(node: yaml.Node, path: Path_, positions: dict, source: str, budget: _Budget) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, (*path, i), positions, source, budget) for i, item in enumerate(node.value)]
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):  # never built nor shown: it may be an alias bomb itself
            kind = "a mapping" if isinstance(key_node, yaml.MappingNode) else "a list"
            raise RecipeError(f"{source}:{key_node.start_mark.line + 1}: mapping keys must be strings, got {kind}")
        key = key_node.value
        if key in out:
            raise RecipeError(f"{source}:{key_node.start_mark.line + 1}: {format_path((*path, key))}: "
                              "duplicate key")
        positions[(*path, key)] = (source, key_node.start_mark.line + 1)
        out[key] = _build(value_node, (*path, key), positions, source, budget)
    return out


def _construct(node: yaml.Node) -> Any:
    """The plain value of an already composed node (tags resolved by the composer), built by the safe loader."""
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _fix_exponent_float(value: Any) -> Any:
    """YAML 1.1 reads ``2e-5`` as a string; learning rates are written that way, so read them as floats."""
    if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


def parse_yaml(text: str, source: str, *, quiet: bool = False) -> SourcedDocument:
    """Parse one YAML document (safe loader) into a :class:`SourcedDocument`. ``quiet``: errors give the line but
    not the parser's description (which may quote the text: for files that may not be recipes at all)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        detail = "not YAML (content not shown)" if quiet else f"malformed YAML: {problem}"
        raise RecipeError(f"{where}: {detail}") from None
    except RecursionError:  # nesting deeper than Python's stack: never a hand-written recipe
        raise RecipeError(f"{source}: YAML nested too deeply") from None
    positions: dict[Path_, tuple[str, int]] = {}
    data = {} if node is None else _build(node, (), positions, source)
    return SourcedDocument(data, positions)


def yaml_value(text: str, source: str) -> Any:
    """The plain value of one small YAML text a person typed or edited (a ``--set`` value, a template file, a
    config file), with the same bounds as a recipe: aliases expand to at most :data:`MAX_VALUES` values, nesting
    stays within the stack. Malformed YAML raises ``yaml.YAMLError`` (callers decide whether that is an error or
    plain text); an alias bomb is a :class:`~alpacafarm.errors.RecipeError` naming ``source``."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise RecipeError(f"{source}: YAML nested too deeply") from None
    if node is None:
        return None
    try:
        return _build(node, (), {}, source)
    except RecursionError:
        raise RecipeError(f"{source}: YAML nested too deeply") from None


def deep_merge(base: SourcedDocument, over: SourcedDocument) -> SourcedDocument:
    """Overlay ``over`` on ``base``: mappings merge key by key, everything else (lists too) is replaced."""
    positions = dict(base.positions)

    def merge(a: Any, b: Any, path: Path_) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for key, value in b.items():
                out[key] = merge(a[key], value, (*path, key)) if key in a else value
                if key not in a or not (isinstance(a[key], dict) and isinstance(value, dict)):
                    _drop_subtree(positions, (*path, key))
                    _copy_subtree(over.positions, positions, (*path, key))
            return out
        return b

    data = merge(base.data, over.data, ())
    return SourcedDocument(data, positions)


def _drop_subtree(positions: dict, prefix: Path_) -> None:
    for key in [k for k in positions if k[: len(prefix)] == prefix]:
        del positions[key]


def _copy_subtree(src: dict, dst: dict, prefix: Path_) -> None:
    for key, value in src.items():
        if key[: len(prefix)] == prefix:
            dst[key] = value


def display_path(path: Path) -> str:
    """A path relative to the working directory when possible (error messages stay short and machine-free)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


#: ``include: alpacafarm:NAME`` names ``NAME.yaml`` in this folder of the installed package.
RECIPE_PARTS_DIR = Path(__file__).parent / "recipe_parts"
PACKAGE_INCLUDE_PREFIX = "alpacafarm:"


def recipe_parts() -> list[str]:
    """The shared recipe pieces that ship with the package (``include: alpacafarm:<name>``)."""
    return sorted(p.stem for p in RECIPE_PARTS_DIR.glob("*.yaml"))


def include_target(including: Path, name: str) -> Path:
    """The file an ``include:`` entry names: ``alpacafarm:NAME`` (a piece shipped in the package, so a recipe
    copied into another repository still finds it) or a path relative to the including file."""
    if name.startswith(PACKAGE_INCLUDE_PREFIX):
        return RECIPE_PARTS_DIR / f"{name[len(PACKAGE_INCLUDE_PREFIX):]}.yaml"
    return including.parent / name


#: At most this many files read for one recipe, includes of includes counted each time they are read: real
#: recipes include one or two pieces; files that each include the next several times fan out exponentially.
MAX_INCLUDES = 64


def load_with_includes(path: Path, _stack: tuple[Path, ...] = (), *,
                       known_keys: frozenset[str] | None = None, _count: list[int] | None = None) -> SourcedDocument:
    """Load ``path``; its ``include:`` (a file or list of files, relative to it, or ``alpacafarm:NAME`` for a piece
    shipped in the package: :func:`recipe_parts`) are merged underneath it. An included file may only hold
    ``known_keys`` (the recipe schema's, given by the caller) when they are given. At most :data:`MAX_INCLUDES`
    files are read in all."""
    path = Path(path)
    _count = [0] if _count is None else _count
    _count[0] += 1
    if _count[0] > MAX_INCLUDES:
        top = display_path(_stack[0]) if _stack else display_path(path)
        raise RecipeError(f"{top}: more than {MAX_INCLUDES} files read through include: (includes that include "
                          f"others several times fan out; last: {display_path(path)})")
    shown = display_path(path)
    if path.is_dir():
        raise RecipeError(f"{shown}: is a directory, not a recipe file")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {shown}")
    resolved = path.resolve()
    if resolved in _stack:
        chain = " -> ".join(display_path(p) for p in (*_stack, resolved))
        raise RecipeError(f"{shown}: include cycle: {chain}")
    included = bool(_stack)
    if included and path.suffix.lower() not in (".yaml", ".yml"):
        raise RecipeError(f"{shown}: an included recipe must be a .yaml or .yml file")
    # An included file may be anything readable (``include: /etc/shadow``): its errors never quote its text.
    doc = parse_yaml(read_text(path, "recipe", display=shown), shown, quiet=included)
    if not isinstance(doc.data, dict):
        raise RecipeError(f"{shown}:1: a recipe must be a YAML mapping, got {type(doc.data).__name__}")
    if included and known_keys is not None:  # the recipe schema's keys (the caller's: no import of the schema here)
        known = {*known_keys, "include"}
        for key in doc.data:
            if key not in known:
                line = doc.positions[(key,)][1]
                raise RecipeError(f"{shown}:{line}: not a recipe key (not shown; an included file holds recipe "
                                  f"keys: {', '.join(sorted(known))})")
    includes = doc.data.pop("include", None)
    if includes is None:
        return doc
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise doc.error(("include",), "must be a file name or a list of file names")
    merged = SourcedDocument({}, {})
    for i, name in enumerate(includes):
        target = include_target(path, name)
        if not target.is_file():
            where = doc.positions.get(("include", i)) or doc.positions.get(("include",))
            loc = f"{where[0]}:{where[1]}: " if where else f"{shown}: "
            if name.startswith(PACKAGE_INCLUDE_PREFIX):
                piece = name[len(PACKAGE_INCLUDE_PREFIX):]
                raise RecipeError(f"{loc}include: {name!r}: alpacafarm ships no recipe piece {piece!r}"
                                  f"{did_you_mean(piece, recipe_parts())} (pieces: {', '.join(recipe_parts())})")
            raise RecipeError(f"{loc}include: file not found: {display_path(target)}")
        merged = deep_merge(merged, load_with_includes(target, (*_stack, resolved), known_keys=known_keys,
                                                       _count=_count))
    doc.positions = {k: v for k, v in doc.positions.items() if k[:1] != ("include",)}
    return deep_merge(merged, doc)


def shown_override(text: str) -> str:
    """``--set`` text as an error message may show it: ``KEY=<redacted>`` when the value is (or looks like) a secret."""
    key, sep, raw = text.partition("=")
    if not sep:
        return repr(REDACTED if looks_like_secret(text) else text)
    value = raw.strip().strip("'\"")
    if shown_value(key.strip().split(".")[-1], value) == REDACTED:
        return repr(f"{key}={REDACTED}")
    return repr(text)


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``"stages.0.config.lr=1e-5"`` → ``(["stages", 0, "config", "lr"], 1e-5)``; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {shown_override(text)}: expected KEY=VALUE, e.g. --set seed=3")
    parts: list[str | int] = [int(p) if p.lstrip("-").isdigit() else p for p in key.strip().split(".")]
    if any(p == "" for p in parts):
        raise RecipeError(f"--set {shown_override(text)}: empty key segment")
    try:  # bounded: an alias bomb in a value would expand into billions of values in what walks it later
        value = yaml_value(raw, f"--set {key.strip()}") if raw.strip() else ""
    except yaml.YAMLError:
        return parts, raw  # not valid YAML: take it as a plain string
    return parts, value


def apply_override(doc: SourcedDocument, text: str) -> None:
    """Set one ``--set`` override in place; list items are addressed by index, stages also by name."""
    parts, value = parse_override(text)
    node: Any = doc.data
    walked: list[str | int] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part)
            if index is None:
                raise RecipeError(f"--set {shown_override(text)}: {format_path(tuple(walked))} has no item {part!r}")
            part = index
            if last:
                node[part] = value
            else:
                node = node[part]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise RecipeError(f"--set {shown_override(text)}: {format_path(tuple(walked))} is a "
                              f"{type(node).__name__}, not a mapping")
        walked.append(part)
    _drop_subtree(doc.positions, tuple(walked))  # the old file positions no longer describe this value
    doc.positions[tuple(walked)] = ("--set", 0)


def _list_index(items: list, part: str | int) -> int | None:
    if isinstance(part, int):
        return part if -len(items) <= part < len(items) else None
    for i, item in enumerate(items):  # stages are easier to address by name: --set stages.sft.config.lr=...
        if isinstance(item, dict) and item.get("name") == part:
            return i
    return None
