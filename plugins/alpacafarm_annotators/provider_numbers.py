"""The one check of the numbers a provider reports about a completion, for the live and the batch path alike.

A provider's ``usage`` decides what the ledger books and what ``max_cost_usd`` counts, so it is believed only when
each field is a non-negative, finite integer no larger than :data:`MAX_REPORTED_TOKENS` (``True`` is not a number,
``12.0`` is 12, ``"12"`` is text). A field that fails is a *problem*: one line naming the field and the value, and
the completion is priced by the caller's own upper bound instead (prompt bytes, ``max_tokens``), as for a reply
that reported no usage at all; the answer itself is kept, so it is never bought twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from alpacafarm.types import Pair

#: More tokens than any model reads or writes in one request (the longest context windows are ~10^6 to 10^7):
#: a count above it is not a count but a provider's bug, and booking it would put a fortune in the ledger.
MAX_REPORTED_TOKENS = 10_000_000
#: The usage fields the ledger books: (prompt tokens, completion tokens).
USAGE_FIELDS = ("prompt_tokens", "completion_tokens")


@dataclass
class UsageReading:
    """What a reply's ``usage`` says: the token counts when every field is believable, else the problems found."""

    tokens_in: int = 0
    tokens_out: int = 0
    reported: bool = False  # the reply carried a ``usage`` at all
    problems: list[str] = field(default_factory=list)  # "usage.prompt_tokens='lots' is not a number", ...

    @property
    def believable(self) -> bool:
        """True when the counts can be booked as they are."""
        return self.reported and not self.problems


def count_problem(value: Any, name: str, bound: int = MAX_REPORTED_TOKENS) -> str | None:
    """Why ``value`` (the provider's field ``name``) is not a token count, or None when it is one."""
    shown = repr(value)[:40]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name}={shown} is not a number" if value is not None else f"{name} is missing"
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return f"{name}={shown} is not a whole number"
    if value < 0:
        return f"{name}={shown} is negative"
    if value > bound:
        return f"{name}={shown} is more than any request can use (at most {bound:,})"
    return None


def _field(usage: Any, name: str) -> Any:
    if isinstance(usage, Mapping):
        return usage.get(name)
    return getattr(usage, name, None)


def read_usage(usage: Any) -> UsageReading:
    """The token counts of a reply's ``usage`` (a mapping from a batch line, or the ``openai`` client's object),
    checked field by field (see the module)."""
    if usage is None:
        return UsageReading()
    if not isinstance(usage, Mapping) and not all(hasattr(usage, n) for n in USAGE_FIELDS) \
            and not hasattr(usage, "model_dump"):
        return UsageReading(reported=True, problems=[f"usage={repr(usage)[:40]} is not an object"])
    reading = UsageReading(reported=True)
    counts = []
    for name in USAGE_FIELDS:
        value = _field(usage, name)
        problem = count_problem(value, f"usage.{name}")
        if problem is not None:
            reading.problems.append(problem)
        counts.append(int(value) if problem is None else 0)
    if reading.believable:
        reading.tokens_in, reading.tokens_out = counts
    return reading


def seconds_between(start: Any, end: Any) -> float:
    """``end - start`` for a provider's two UNIX times, or 0.0 when either is not a finite number (a latency only:
    nothing is billed by it) or they are out of order."""
    numbers = [v for v in (start, end) if not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)]
    return max(0.0, float(end) - float(start)) if len(numbers) == 2 else 0.0


def describe_pairs(keys: Sequence[str], pairs: Mapping[str, Pair]) -> str:
    """The pairs of one request, for a message: the first one's cache key (its start) and instruction, if known."""
    first = keys[0] if keys else "?"
    pair = pairs.get(first)
    shown = f"pair {first[:12]}" + (f" ({pair.instruction[:60]!r})" if pair is not None else "")
    return shown + (f" and {len(keys) - 1} more in the same request" if len(keys) > 1 else "")
