"""Error bars for the labelling report: bootstrap intervals over pairs, and the minimum of shared pairs.

Each figure is recomputed on ``n_bootstrap`` resamples of the pairs it rests on (drawn with replacement, seeded);
the interval is the 2.5th and 97.5th percentiles. Pairs are the unit because the labels of one pair are not
independent (the same two answers). Below :data:`MIN_SHARED_PAIRS` pairs labelled by two or more people the
report warns that human-human figures are too uncertain to compare with anything; ``alpacafarm label serve``'s
default overlap gives at least that many.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from alpacafarm_validation.agreement import PairKey, mode, score

#: Pairs labelled by 2 or more people below which the report warns (with 20 pairs a 70% agreement's interval is
#: still about ±20 points; with 3, as the old 10% of 30 pairs gave, it says nothing).
MIN_SHARED_PAIRS = 20
T = TypeVar("T")


def percentile_interval(values: list[float]) -> list[float] | None:
    """[2.5th, 97.5th] percentile of ``values`` (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]  # noqa: E731
    return [pick(0.025), pick(0.975)]


def bootstrap(units: Sequence[T], statistic: Callable[[list[T]], float | None], n_bootstrap: int,
              seed: int, what: str) -> list[float] | None:
    """Percentile interval of ``statistic`` over resamples of ``units`` (resamples where it is undefined are
    dropped); None with fewer than 2 units."""
    if len(units) < 2 or n_bootstrap < 1:
        return None
    rng = random.Random(f"{seed}:{what}")
    values = []
    for _ in range(n_bootstrap):
        value = statistic([units[rng.randrange(len(units))] for _ in units])
        if value is not None:
            values.append(value)
    return percentile_interval(values)


def cohen_kappa(a: list[float], b: list[float]) -> float | None:
    """Cohen's kappa of two raters' labels of the same items (categories 1, 2, tie); None when chance agreement is
    1 (both raters always gave the same single label) or there is nothing to compare."""
    from collections import Counter

    if not a or len(a) != len(b):
        return None
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    count_a, count_b = Counter(a), Counter(b)
    chance = sum(count_a[c] * count_b[c] for c in set(a) | set(b)) / len(a) ** 2
    return None if chance >= 1 else (observed - chance) / (1 - chance)


def held_out_per_pair(labels: dict[PairKey, list[float]], seed: int) -> list[float]:
    """Per pair (2+ labels): the mean over its labels of the score against the majority of the others' — the
    terms whose mean is the human-human agreement (``agreement.leave_one_out``, same tie-breaks)."""
    out = []
    for key, values in labels.items():
        if len(values) >= 2:
            out.append(sum(score(v, mode(values[:i] + values[i + 1:], seed, "humans", *key, i))
                           for i, v in enumerate(values)) / len(values))
    return out


def light_kappa_of(pairs: list[dict[str, float]]) -> float | None:
    """Light's kappa over items given as {labeller: label}: the mean over labeller pairs of Cohen's kappa on the
    items both labelled (undefined pairs left out)."""
    labellers = sorted({name for item in pairs for name in item})
    kappas = []
    for a, b in itertools.combinations(labellers, 2):
        shared = [item for item in pairs if a in item and b in item]
        kappa = cohen_kappa([i[a] for i in shared], [i[b] for i in shared])
        if kappa is not None:
            kappas.append(kappa)
    return sum(kappas) / len(kappas) if kappas else None


def human_intervals(humans: dict[PairKey, list[tuple[str, float]]], seed: int, n_bootstrap: int) -> dict[str, Any]:
    """Bootstrap intervals (over shared pairs) of human-human agreement and Light's kappa."""
    shared = {k: v for k, v in humans.items() if len(v) >= 2}
    per_pair = held_out_per_pair({k: [label for _, label in v] for k, v in shared.items()}, seed)
    items = [dict(v) for v in shared.values()]
    return {"agreement_interval": bootstrap(per_pair, lambda s: sum(s) / len(s), n_bootstrap, seed, "hh"),
            "kappa_interval": bootstrap(items, light_kappa_of, n_bootstrap, seed, "hh-kappa")}


def simulator_intervals(per_pair: list[tuple[list[float], list[tuple[float, float]]]], seed: int,
                        n_bootstrap: int) -> dict[str, Any]:
    """Bootstrap intervals (over pairs) of a simulator's agreement and kappa; each unit is one pair's (scores of
    its human labels, (human, simulator) label pairs)."""
    def agreement(sample: list[Any]) -> float | None:
        scores = [s for unit in sample for s in unit[0]]
        return sum(scores) / len(scores) if scores else None

    def kappa(sample: list[Any]) -> float | None:
        both = [p for unit in sample for p in unit[1]]
        return cohen_kappa([h for h, _ in both], [s for _, s in both])

    return {"agreement_interval": bootstrap(per_pair, agreement, n_bootstrap, seed, "sim"),
            "kappa_interval": bootstrap(per_pair, kappa, n_bootstrap, seed, "sim-kappa")}


def shared_pairs_warning(n_shared: int) -> str | None:
    """The report's warning when fewer than :data:`MIN_SHARED_PAIRS` pairs carry labels from 2 or more people."""
    if n_shared >= MIN_SHARED_PAIRS:
        return None
    return (f"only {n_shared} pairs have labels from 2 or more people (minimum {MIN_SHARED_PAIRS}): human-human "
            "agreement and kappa are too uncertain to compare a simulator with; label more shared pairs "
            "(alpacafarm label serve's default overlap gives the minimum)")
