"""Parsers that read an annotator's completion into one preference per pair, never guessing.

Every parser takes ``(text, n)`` and returns ``n`` preferences (each 1 or 2) only when pairs 1..n each got
exactly one clear answer; anything else (missing, duplicated or out-of-range pairs, ties, garbage) gives
``None``, and the caller re-requests once and then marks the batch unparsed.

- ``ranking``: one answer per pair, such as ``Pair 3: 2``, ``pair 3 - Output (2)`` or ``3: (2)``.
- ``json``: a JSON list of ``{"pair": k, "reasoning": "...", "preferred": 1|2}`` (fenced or in prose), or an
  object holding such a list; for a single pair, also one object without ``pair``.
- ``single``: batch size 1, a line such as ``Output (2)``, ``2`` or ``Better output: Output (2)`` (or
  ``Pair 1: 2``), possibly amid prose lines; conflicting answer lines give ``None``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from alpacafarm.types import Preference

Parser = Callable[[str, int], "list[Preference] | None"]

# The answer token: "2", "(2)", "[2]", "Output 2", "output (2)", "Response #2".
_CHOICE = r"(?:(?:output|response|answer)\s*#?\s*)?[(\[]?\s*(?P<choice>[12])\s*[)\]]?"
# What may follow the answer token on the same line: nothing, punctuation then anything, or "is better".
_END = (r"(?=[ \t]*(?:$|[.,;:](?!\d)|[(\[]|[-\u2013\u2014][ \t]|is[ \t]+(?:better|preferred)\b"
        r"|(?:better|preferred)\b|pair\b))")
_SEP = r"(?:\s*[:=\-\u2013\u2014\u2192>)]+\s*|\.[ \t]+)"
# "Pair 3: 2" anywhere (several may share a line); a bare "3: 2" only at the start of a line.
_WITH_WORD = re.compile(rf"\bpair\s*#?\s*(?P<index>\d+){_SEP}{_CHOICE}{_END}", re.I | re.M)
_BARE = re.compile(rf"^[ \t>#-]*(?P<index>\d+){_SEP}{_CHOICE}{_END}", re.I | re.M)


def _strip_markup(text: str) -> str:
    """Drop emphasis and code markup (``**``, ``__``, backticks) that models sprinkle around answers."""
    return re.sub(r"\*+|__|`+", "", text)


def _all_or_nothing(found: list[tuple[int, int]], n: int) -> list[Preference] | None:
    """``n`` labels when ``found`` holds exactly the pairs 1..n once each, else None."""
    if n < 1 or len(found) != n:
        return None
    labels: dict[int, int] = {}
    for index, choice in found:
        if index in labels or not 1 <= index <= n or choice not in (1, 2):
            return None
        labels[index] = choice
    return [labels[i] for i in range(1, n + 1)]


def _ranking_answers(text: str) -> list[tuple[int, int]]:
    """Every ``(pair, choice)`` answer found in ``text``, in order of appearance."""
    clean = _strip_markup(text)
    matches = {m.start(): m for m in _WITH_WORD.finditer(clean)}
    for m in _BARE.finditer(clean):
        if not any(s <= m.start() < w.end() or m.start() <= s < m.end() for s, w in matches.items()):
            matches[m.start()] = m
    return [(int(m["index"]), int(m["choice"])) for _, m in sorted(matches.items())]


def parse_ranking(text: str, n: int) -> list[Preference] | None:
    """Per-pair answers (``Pair k: X`` and variants) amid any prose; None unless exactly pairs 1..n answered."""
    return _all_or_nothing(_ranking_answers(text), n)


def _json_candidates(text: str) -> list[Any]:
    """JSON values found in ``text``: fenced blocks first, then every decodable ``[...]``/``{...}`` in prose."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    for block in re.findall(r"```(?:json)?\s*(.*?)```", text, re.S | re.I):
        try:
            values.append(json.loads(block))
        except ValueError:
            continue
    pos = 0
    while True:
        starts = [i for i in (text.find("[", pos), text.find("{", pos)) if i >= 0]
        if not starts:
            return values
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        values.append(value)
        pos = end


def _as_rows(value: Any, n: int) -> list[dict[str, Any]] | None:
    """The list of per-pair objects a JSON value holds, if it has the expected shape."""
    if isinstance(value, dict):
        if n == 1 and "preferred" in value:
            return [{"pair": 1, **value}]
        lists = [v for v in value.values() if isinstance(v, list)]
        value = lists[0] if len(lists) == 1 else None
    if isinstance(value, list) and value and all(isinstance(r, dict) and "preferred" in r for r in value):
        return value
    return None


def _as_choice(value: Any) -> int | None:
    """1 or 2 from ``1``, ``"2"``, ``"Output (2)"``; booleans and anything else are not a choice."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value in (1, 2) else None
    if isinstance(value, str):
        m = re.fullmatch(rf"\s*{_CHOICE}\s*", value, re.I)
        return int(m["choice"]) if m else None
    return None


def _as_index(value: Any) -> int | None:
    """A pair number from ``3`` or ``"3"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def parse_json(text: str, n: int) -> list[Preference] | None:
    """A JSON list of ``{"pair", "reasoning", "preferred"}`` objects; the first list of that shape decides."""
    for value in _json_candidates(text):
        rows = _as_rows(value, n)
        if rows is None:
            continue
        found = []
        for row in rows:
            index, choice = _as_index(row.get("pair")), _as_choice(row.get("preferred"))
            if index is None or choice is None:
                return None
            found.append((index, choice))
        return _all_or_nothing(found, n)
    return None


_SINGLE = re.compile(
    r"(?:(?:the\s+)?(?:better|preferred|best|chosen)(?:\s+output)?|answer|verdict|preference)?\s*[:\-]?\s*"
    rf"{_CHOICE}\s*(?:is\s+(?:the\s+)?(?:better|preferred)(?:\s+(?:one|output))?)?\s*\.?",
    re.I,
)


def parse_single(text: str, n: int) -> list[Preference] | None:
    """One pair: the answer is a line that is nothing but an answer (``Output (2)``, ``2``, ``Answer: 1``) or a
    ``Pair 1: X`` line; prose lines around it are ignored. No such line, or two that disagree, gives None, so
    free-form text ("the second one is better") is never guessed."""
    if n != 1:
        return None
    lines = [line.strip().lstrip("#> ").strip() for line in _strip_markup(text).splitlines()]
    choices = {int(m["choice"]) for m in map(_SINGLE.fullmatch, lines) if m is not None}
    for index, choice in _ranking_answers(text):
        if index != 1:
            return None
        choices.add(choice)
    return [choices.pop()] if len(choices) == 1 else None


PARSERS: dict[str, Parser] = {"ranking": parse_ranking, "json": parse_json, "single": parse_single}


def parse(parser_name: str, text: str, n: int) -> list[Preference] | None:
    """Read ``text`` with the named parser; unknown names raise ValueError listing the known parsers."""
    try:
        parser = PARSERS[parser_name]
    except KeyError:
        raise ValueError(f"unknown parser {parser_name!r} (known: {', '.join(PARSERS)})") from None
    return parser(text or "", n)
