"""A pool of annotators with AlpacaFarm's semantics: a crowd, not a single judge.

For every pair, with draws seeded by a stable hash (identical in every process and on every machine):

- **assignment**: the annotator is chosen per instruction (``seed``, instruction, input), as one crowd worker
  would take a task;
- **order**: the two outputs are shown in a random order (keyed on the unordered pair, so ``(a, b)`` and
  ``(b, a)`` are shown identically and get mirrored labels), and the answer is mapped back ("unswapped");
- **label noise** (``p_label_flip``, 0.25 for p_sim^ann): with probability ``2 * p_label_flip`` the label is a fair
  coin instead of an annotation, so it flips with probability ``p_label_flip``. Such pairs are neither sent nor
  cached — training feedback costs half as much, as the paper notes.

**Replicates** (``annotate(pairs, replicate=k)``): replicate 0 is the draw described above; replicate k > 0 adds
k to every seed (a new member per instruction, a new order, a new coin) and asks its member for replicate k (an
API judge then samples afresh, under its own cache key). Repeats of one pair thus vary as in the paper's
variance measurement ("a held-out annotation against the majority vote over 3 random draws"), even over
deterministic members once there is label noise or more than one member.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from alpacafarm.annotation import (
    AnnotationPending,
    Annotator,
    ProgressCallback,
    aannotate_replicate,
    identical_tie,
)
from alpacafarm.annotation_cache import LedgerTotals
from alpacafarm.seeding import stable_hash, stable_uniform
from alpacafarm.types import Annotation, Pair, Preference, flip
from alpacafarm_annotators.config import PoolConfig


def _replicate_parts(replicate: int) -> tuple[object, ...]:
    """What replicate k adds to a seed: nothing for 0 (the draws every pool made before replicates existed)."""
    return ("replicate", replicate) if replicate else ()


def unswap(preference: Preference | float) -> Preference | float:
    """A label given to the swapped pair, in the caller's order: 1 <-> 2, and a continuous preference p in [1, 2]
    (AlpacaEval's logprob-weighted judges) becomes 3 - p; a tie (0) and None stay as they are."""
    if isinstance(preference, float) and preference != 0:
        return 3.0 - preference
    return flip(preference)


class AnnotatorPool(Annotator):
    accepts_replicate = True  # a replicate redraws members, order and noise, and is asked of each member

    def __init__(self, config: PoolConfig, members: dict[str, Annotator], name: str = "pool") -> None:
        missing = [m for m in config.annotators if m not in members]
        if missing:
            raise ValueError(f"pool {name!r}: no annotator object for {', '.join(missing)}")
        self.config = config
        self.members = [members[m] for m in config.annotators]
        self.name = name

    def usage(self) -> LedgerTotals:
        """What the members paid in this run (a shared member is counted once)."""
        total = LedgerTotals(0, 0, 0, 0.0)
        for member in {id(m): m for m in self.members}.values():
            used = member.usage()
            total.add(used.tokens_in, used.tokens_out, used.price_usd, used.requests)
        return total

    @property
    def endpoint(self) -> str | None:
        """The members' endpoints (base URLs), comma-separated; None when no member calls one."""
        found = dict.fromkeys(e for m in self.members if (e := getattr(m, "endpoint", None)))
        return ", ".join(found) or None

    def describe(self) -> dict[str, Any]:
        """The pool and its resolved members (each member's own ``describe()`` when it has one)."""
        members = [m.describe() if hasattr(m, "describe") else {"name": getattr(m, "name", type(m).__name__),
                                                                "kind": type(m).__name__} for m in self.members]
        return {"name": self.name, "description": self.config.description, "p_label_flip": self.config.p_label_flip,
                "randomize_order": self.config.randomize_order, "seed": self.config.seed, "members": members}

    def member_index(self, pair: Pair, replicate: int = 0) -> int:
        """Which member annotates this pair's instruction (in replicate ``replicate``)."""
        return stable_hash(self.config.seed, "assign", pair.instruction, pair.input,
                           *_replicate_parts(replicate)) % len(self.members)

    def _draws(self, pair: Pair, replicate: int = 0) -> tuple[Pair, bool, int | None]:
        """(pair as shown, shown swapped relative to the caller's order, noise label in the caller's order or None)."""
        low, high = sorted((pair.output_1, pair.output_2))
        key = (self.config.seed, pair.instruction, pair.input, low, high, *_replicate_parts(replicate))
        canonical = Pair(pair.instruction, low, high, pair.input)
        caller_is_canonical = pair.output_1 == low
        noise: int | None = None
        if stable_uniform(*key, "noise") < 2 * self.config.p_label_flip:
            coin = 1 + stable_hash(*key, "coin") % 2  # in canonical order, then mapped to the caller's order
            noise = coin if caller_is_canonical else flip(coin)
        if not self.config.randomize_order:
            return pair, False, noise  # shown exactly as given
        shown = canonical.swapped() if stable_hash(*key, "swap") % 2 else canonical
        return shown, shown.output_1 != pair.output_1, noise

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        results: list[Annotation | None] = [None] * len(pairs)
        work: dict[int, list[tuple[int, Pair, bool]]] = {}
        for i, pair in enumerate(pairs):
            tie = identical_tie(pair, self.name)
            if tie is not None:
                results[i] = tie
                continue
            shown, swapped, noise = self._draws(pair, replicate)
            if noise is not None:
                results[i] = Annotation(noise, "noise", noise=True, metadata={"p_label_flip": self.config.p_label_flip})
                continue
            work.setdefault(self.member_index(pair, replicate), []).append((i, shown, swapped))
        if progress and len(pairs) - sum(len(w) for w in work.values()):
            progress(len(pairs) - sum(len(w) for w in work.values()), 0.0)

        async def run_member(member: int, items: list[tuple[int, Pair, bool]]) -> None:
            annotations = await aannotate_replicate(self.members[member], [shown for _, shown, _ in items], progress,
                                                    replicate)
            for (i, _, swapped), annotation in zip(items, annotations, strict=True):
                if swapped:
                    annotation.preference = unswap(annotation.preference)
                annotation.swapped = swapped
                results[i] = annotation

        # Every member finishes its share before an error is raised: a member whose batches are still pending must
        # not cut short the others' submissions (each records its own batches; a re-run collects them all).
        raised = [e for e in await asyncio.gather(*(run_member(m, items) for m, items in work.items()),
                                                  return_exceptions=True) if isinstance(e, BaseException)]
        if raised:
            pending = [e for e in raised if isinstance(e, AnnotationPending)]
            if len(pending) < len(raised):
                raise next(e for e in raised if not isinstance(e, AnnotationPending))
            raise AnnotationPending(f"{self.name}: {len(pending)} member(s) have batches pending, re-run to collect; "
                                    f"{pending[0]}" if len(pending) > 1 else str(pending[0]))
        return [r if r is not None else Annotation(None, self.name, outcome="failed",
                                                   metadata={"error": "no answer"}) for r in results]
