"""What a Quark round samples, keeps and trains on: its prompts, the top quantile of its pool, the draw order.

Plain functions of the round's numbers, seeded, so that a resumed run repeats them exactly; checked against the
released implementation's ``DataPool`` in ``tests/test_ppo_oracle.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from alpacafarm_methods.quark.config import QuarkMethodConfig


def kept_count(pool_size: int, quantile: float) -> int:
    """How many of a pool form its top ``quantile``: ``floor(quantile * pool_size)``, at least one.

    Rounded down as in the released implementation, whose top bin of ``b`` holds ``pool_size // b`` samples
    (128 of 512 for its 4 bins); at least one, so a tiny pool still trains.
    """
    return min(pool_size, max(1, math.floor(round(quantile * pool_size, 9))))


def top_quantile(rewards: Sequence[float], quantile: float) -> list[int]:
    """Indices (ascending) of the ``kept_count`` highest rewards; ties at the threshold go to earlier ones."""
    ranked = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    return sorted(ranked[:kept_count(len(rewards), quantile)])


def top_quantile_per_group(rewards: Sequence[float], groups: Sequence[object], quantile: float) -> list[int]:
    """Indices (ascending) of each group's own top ``quantile`` (``kept_count`` of the group's size, at least one):
    the per-instruction cut (``quantile_scope: instruction``), where the released cut is over the whole pool.

    With most of a reward's variance between instructions, the pool-wide cut keeps mostly answers to easy prompts;
    this one keeps the best answers to every prompt, so what is learnt is "answer better", not "which prompts score".
    """
    members: dict[object, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    kept = [indices[k] for indices in members.values()
            for k in top_quantile([rewards[i] for i in indices], quantile)]
    return sorted(kept)


def draw_order(n_kept: int, n_draws: int, seed: int) -> list[int]:
    """``n_draws`` indices into the kept samples: passes over them, each a fresh seeded permutation, cut at
    ``n_draws`` (the released trainer's shuffled, cycling loader: 256 draws from 128 kept are two passes)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < n_draws:
        permutation = list(range(n_kept))
        rng.shuffle(permutation)
        order.extend(permutation)
    return order[:n_draws]


def round_prompts(n_records: int, args: QuarkMethodConfig, seed: int) -> list[list[int]]:
    """Record indices of every round: a seeded order of all records, taken ``prompts_per_round`` at a time and
    wrapping around, so every round has the same number of prompts (and of kept samples)."""
    order = list(range(n_records))
    random.Random(seed).shuffle(order)
    per_round = min(args.prompts_per_round or n_records, n_records)
    return [[order[(r * per_round + j) % n_records] for j in range(per_round)] for r in range(args.rounds)]
