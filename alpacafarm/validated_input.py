"""The one way in for a file or value a person may have edited: baselines, recipes, ``--set``, templates, pairs,
outputs, manifests.

Whatever the file claims to be, what comes out of here is bounded (size, nesting, values once YAML aliases and
includes are expanded), UTF-8, with finite numbers only, and every refusal is a :class:`~alpacafarm.errors.UserError`
(exit status 2) in one line naming the file and the field. Schema checks on top use :class:`Fields`, which keeps
the dotted path of every value it hands out so that an error says ``gate.margin`` rather than ``KeyError``.

YAML goes through :func:`alpacafarm.yamlsource.parse_yaml` (safe loader, alias expansion bounded by
``MAX_VALUES``), which is where recipes, their includes and ``--set`` values are read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError

#: Largest edited JSON file read whole (a bench baseline of 805 instructions x 20 systems is ~2 MB).
MAX_JSON_BYTES = 64 * 1024 * 1024
#: Deepest nesting accepted in an edited file: real ones are a handful of levels; Python's parser would overflow
#: its stack (RecursionError) on a few thousand.
MAX_DEPTH = 64


class InputError(UserError):
    """A file or value a person edited that does not validate: one line naming the file and the field."""


def _non_finite(token: str) -> float:
    raise ValueError(f"{token} is not a finite number")


def load_json(path: str | Path, what: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH,
              display: str | None = None) -> Any:
    """The JSON value of ``path``: UTF-8, at most ``max_bytes``, nested at most ``max_depth`` deep, no NaN or
    Infinity. ``what`` says what the file is in messages (``"--baseline"``)."""
    from alpacafarm.paths import read_text

    path = Path(path)
    shown = display or f"{what} {path}"
    if path.is_dir():
        raise InputError(f"{shown} is a directory, not a file")
    if not path.is_file():
        raise InputError(f"{shown}: no such file")
    if path.stat().st_size > max_bytes:
        raise InputError(f"{shown} is larger than {max_bytes:,} bytes")
    return parse_json(read_text(path, what, display=shown), shown, max_depth=max_depth)


def parse_json(text: str, shown: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """:func:`load_json` on text already read (``shown`` names it)."""
    depth = _bracket_depth(text)
    if depth > max_depth:
        raise InputError(f"{shown}: nested {depth} levels deep (at most {max_depth})")
    try:
        return json.loads(text, parse_constant=_non_finite)
    except RecursionError:
        raise InputError(f"{shown}: nested too deeply") from None
    except ValueError as exc:
        raise InputError(f"{shown} is not JSON ({str(exc).splitlines()[0][:160]})") from None


def _bracket_depth(text: str) -> int:
    """How deep ``[`` / ``{`` nest outside strings (checked before parsing: the parser itself recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _type_name(value: Any) -> str:
    return "null" if value is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
                                         int: "a number", float: "a number"}.get(type(value), type(value).__name__)


class Fields:
    """A checked view of one JSON object: ``Fields(data, "--baseline b.json")["gate"].number("margin", ...)``.

    Each accessor refuses a missing key or a value of the wrong type, range or size with one line naming the
    source and the dotted path of the field.
    """

    def __init__(self, data: Any, source: str, path: str = "") -> None:
        self.source, self.path = source, path
        if not isinstance(data, dict):
            raise self.error(f"must be an object, got {_type_name(data)}")
        self.data = data

    def error(self, message: str, key: str | None = None) -> InputError:
        field = ".".join(p for p in (self.path, key) if p) or "(top level)"
        return InputError(f"{self.source}: {field}: {message}; write a new one rather than editing it by hand"
                          if self.source.startswith("--baseline") else f"{self.source}: {field}: {message}")

    def _get(self, key: str, default: Any, required: bool) -> Any:
        if key not in self.data:
            if required:
                raise self.error("missing", key)
            return default
        return self.data[key]

    def sub(self, key: str, *, required: bool = True) -> Fields:
        """The object at ``key`` as :class:`Fields` (an empty one when absent and not ``required``)."""
        value = self._get(key, {}, required)
        return Fields(value, self.source, ".".join(p for p in (self.path, key) if p))

    def number(self, key: str, *, low: float | None = None, high: float | None = None, open_low: bool = False,
               open_high: bool = False, required: bool = True, default: float | None = None,
               nullable: bool = False) -> float | None:
        """A finite number (not a boolean, not a string) within ``[low, high]`` (open ends when asked)."""
        value = self._get(key, default, required)
        if value is None and (nullable or not required):
            return value
        return finite(value, lambda message: self.error(message, key), low=low, high=high, open_low=open_low,
                      open_high=open_high)

    def text(self, key: str, *, required: bool = True, default: str | None = None, max_len: int = 1_000_000) -> str:
        value = self._get(key, default, required)
        if not isinstance(value, str):
            raise self.error(f"must be a string, got {_type_name(value)}", key)
        if len(value) > max_len:
            raise self.error(f"longer than {max_len:,} characters", key)
        return value

    def items(self, key: str | None = None, *, max_items: int = 1_000_000) -> Iterator[tuple[str, Fields]]:
        """``(name, Fields)`` for each member of the object at ``key`` (this object when None): all objects."""
        target = self if key is None else self.sub(key)
        if len(target.data) > max_items:
            raise target.error(f"more than {max_items:,} entries")
        for name, value in target.data.items():
            yield name, Fields(value, self.source, ".".join(p for p in (target.path, name) if p))

    def objects(self, key: str, *, max_items: int = 1_000_000, required: bool = True) -> list[Fields]:
        """The list at ``key``, each item an object."""
        value = self._get(key, [], required)
        where = ".".join(p for p in (self.path, key) if p)
        if not isinstance(value, list):
            raise self.error(f"must be a list, got {_type_name(value)}", key)
        if len(value) > max_items:
            raise self.error(f"more than {max_items:,} items", key)
        return [Fields(item, self.source, f"{where}[{i}]") for i, item in enumerate(value)]


def finite(value: Any, error: Any, *, low: float | None = None, high: float | None = None, open_low: bool = False,
           open_high: bool = False) -> float:
    """``value`` as a float when it is a finite number within the bounds; else ``raise error(message)``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"must be a number, got {_type_name(value)}")
    if not math.isfinite(value):
        raise error(f"must be a finite number, got {value}")
    too_low = low is not None and (value <= low if open_low else value < low)
    too_high = high is not None and (value >= high if open_high else value > high)
    if too_low or too_high:
        left, right = ("(" if open_low else "["), (")" if open_high else "]")
        raise error(f"must be in {left}{'-inf' if low is None else f'{low:g}'}, "
                    f"{'inf' if high is None else f'{high:g}'}{right}, got {value:g}")
    return float(value)


def json_ready(value: Any) -> Any:
    """Plain data with every non-finite float replaced by None: ``json.dumps`` would write bare ``NaN`` or
    ``Infinity``, which is not JSON (strict parsers, ``jq``, CI tools refuse it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value
