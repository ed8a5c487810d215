"""The pool's AlpacaFarm semantics with real (deterministic) member annotators: assignment, order, noise."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from alpacafarm.annotation import Annotator
from alpacafarm.errors import UserError
from alpacafarm.types import Annotation, Pair
from alpacafarm_annotators.config import PoolConfig
from alpacafarm_annotators.pool import AnnotatorPool


class LongerJudge(Annotator):
    """Prefers the longer output as shown; records what it was asked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[Pair] = []
        self.replicates: set[int] = set()

    accepts_replicate = True

    async def aannotate(self, pairs: Sequence[Pair], progress=None, *, replicate: int = 0) -> list[Annotation]:
        self.seen.extend(pairs)
        self.replicates.add(replicate)
        return [Annotation(1 if len(p.output_1) > len(p.output_2) else 2, self.name) for p in pairs]


class FirstJudge(LongerJudge):
    """Always prefers whatever is shown first: pure position bias."""

    async def aannotate(self, pairs: Sequence[Pair], progress=None, *, replicate: int = 0) -> list[Annotation]:
        self.seen.extend(pairs)
        self.replicates.add(replicate)
        return [Annotation(1, self.name) for _ in pairs]


class LegacyJudge(Annotator):
    """An annotator written before replicates existed: its aannotate takes no ``replicate``."""

    name = "legacy"

    async def aannotate(self, pairs: Sequence[Pair], progress=None) -> list[Annotation]:
        return [Annotation(1, self.name) for _ in pairs]


def make_pairs(n: int) -> list[Pair]:
    return [Pair(f"instruction {i}", "short" + "!" * (i % 3), "a much longer answer " * (1 + i % 4)) for i in range(n)]


def pool(members: list[Annotator], **config) -> AnnotatorPool:
    return AnnotatorPool(PoolConfig(annotators=[m.name for m in members], **config), {m.name: m for m in members})


def binomial_bounds(n: int, p: float, sigmas: float = 4.5) -> tuple[float, float]:
    spread = sigmas * math.sqrt(p * (1 - p) / n)
    return p - spread, p + spread


def test_unswapping_recovers_the_judgment_in_the_callers_order():
    judges = [LongerJudge("a"), LongerJudge("b"), LongerJudge("c")]
    pairs = make_pairs(600)
    annotations = pool(judges).annotate(pairs)
    assert all(a.preference == 2 for a in annotations)  # output_2 is always the longer one
    swapped = sum(a.swapped for a in annotations) / len(pairs)
    low, high = binomial_bounds(len(pairs), 0.5)
    assert low < swapped < high
    assert {a.annotator for a in annotations} == {"a", "b", "c"}


def test_order_randomisation_cancels_position_bias():
    annotations = pool([FirstJudge("first")]).annotate(make_pairs(2000))
    share_first = sum(a.preference == 1 for a in annotations) / 2000
    low, high = binomial_bounds(2000, 0.5)
    assert low < share_first < high
    assert all(a.preference == 1 for a in pool([FirstJudge("first")], randomize_order=False).annotate(make_pairs(50)))


def test_assignment_is_per_instruction():
    judges = [LongerJudge(str(i)) for i in range(5)]
    pairs = [Pair(f"instruction {i % 40}", f"x{i}", f"yy{i}") for i in range(400)]
    annotations = pool(judges, seed=3).annotate(pairs)
    by_instruction: dict[str, set[str]] = {}
    for pair, annotation in zip(pairs, annotations, strict=True):
        by_instruction.setdefault(pair.instruction, set()).add(annotation.annotator)
    assert all(len(names) == 1 for names in by_instruction.values())
    assert len({next(iter(n)) for n in by_instruction.values()}) == 5  # all members get work


def test_label_noise_rate_and_that_noisy_pairs_are_never_sent():
    judge = LongerJudge("j")
    n = 4000
    annotations = pool([judge], p_label_flip=0.25).annotate(make_pairs(n))
    noisy = [a for a in annotations if a.noise]
    low, high = binomial_bounds(n, 0.5)
    assert low < len(noisy) / n < high  # half the pairs are replaced by a coin ...
    flipped = sum(a.preference != 2 for a in annotations) / n
    low, high = binomial_bounds(n, 0.25)
    assert low < flipped < high  # ... so a quarter of the labels flip
    assert len(judge.seen) == n - len(noisy)
    assert all(a.annotator == "noise" and a.price_usd == 0 for a in noisy)


def test_mirrored_pairs_get_mirrored_labels_even_with_noise():
    pairs = make_pairs(300)
    p = pool([FirstJudge("f"), LongerJudge("l")], p_label_flip=0.25, seed=9)
    forward = p.annotate(pairs)
    backward = p.annotate([q.swapped() for q in pairs])
    assert all({a.preference, b.preference} == {1, 2} for a, b in zip(forward, backward, strict=True))


def test_identical_outputs_are_ties_without_a_request():
    judge = LongerJudge("j")
    annotations = pool([judge], p_label_flip=0.25).annotate([Pair("i", "same", "same "), Pair("i", "a", "bb")])
    assert annotations[0].preference == 0 and len(judge.seen) == 1


DRAWS_SCRIPT = """
import json, sys
import pytest

from alpacafarm.annotation import Annotator
from alpacafarm.errors import UserError
from alpacafarm.types import Pair
from alpacafarm_annotators.config import PoolConfig
from alpacafarm_annotators.pool import AnnotatorPool
names = ["m0", "m1", "m2"]
members = {n: Annotator() for n in names}
for n, m in members.items():
    m.name = n
pool = AnnotatorPool(PoolConfig(annotators=names, p_label_flip=0.25, seed=int(sys.argv[1])), members)
pairs = [Pair(f"instr {i}", f"out-a {i}", f"out-b {i * 7}") for i in range(200)]
print(json.dumps([[pool.member_index(p), *pool._draws(p)[1:]] for p in pairs]))
"""


def test_same_seed_gives_the_same_draws_in_two_processes():
    runs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", DRAWS_SCRIPT, "5"], capture_output=True, text=True, env=env,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        runs.append(json.loads(result.stdout))
    assert runs[0] == runs[1]
    other_seed = subprocess.run([sys.executable, "-c", DRAWS_SCRIPT, "6"], capture_output=True, text=True, timeout=120)
    assert json.loads(other_seed.stdout) != runs[0]


# --- replicates: independent repeats of the same annotation -------------------------------------------------------

# Computed with the code before replicates existed (seed 5, members m0-m2, DRAWS_SCRIPT's pairs 0-11):
# [member, shown swapped, noise label]. Replicate 0 must stay exactly this.
OLD_DRAWS = [[1, False, None], [1, True, 2], [0, False, None], [0, False, None], [0, False, 1], [1, True, 2],
             [1, True, 1], [0, True, 2], [1, True, 2], [2, True, 1], [2, True, 1], [1, True, None]]


def test_replicate_zero_draws_are_the_draws_before_replicates_existed():
    names = ["m0", "m1", "m2"]
    p = pool([LongerJudge(n) for n in names], p_label_flip=0.25, seed=5)
    pairs = [Pair(f"instr {i}", f"out-a {i}", f"out-b {i * 7}") for i in range(12)]
    assert [[p.member_index(q), *p._draws(q)[1:]] for q in pairs] == OLD_DRAWS
    assert [[p.member_index(q, 0), *p._draws(q, 0)[1:]] for q in pairs] == OLD_DRAWS
    assert [[p.member_index(q, 1), *p._draws(q, 1)[1:]] for q in pairs] != OLD_DRAWS


def test_replicates_redraw_member_order_and_noise_independently():
    judges = [LongerJudge("a"), LongerJudge("b"), LongerJudge("c")]
    p = pool(judges, p_label_flip=0.25, seed=2)
    pairs = make_pairs(1200)
    first, second = p.annotate(pairs, replicate=0), p.annotate(pairs, replicate=1)
    assert [a.preference for a in p.annotate(pairs)] == [a.preference for a in first]  # 0 is the default
    assert [a.preference for a in p.annotate(pairs, replicate=1)] == [a.preference for a in second]  # seeded
    assert {j for judge in judges for j in judge.replicates} == {0, 1}  # members are asked for the replicate
    # every member says 2; half the labels are a coin, so P(label = 2) = 3/4 in each replicate, and two
    # independent replicates disagree with probability 2 * 3/4 * 1/4 = 3/8 (identical draws: never)
    disagree = sum(a.preference != b.preference for a, b in zip(first, second, strict=True)) / len(pairs)
    low, high = binomial_bounds(len(pairs), 3 / 8)
    assert low < disagree < high
    both_sent = [(a, b) for a, b in zip(first, second, strict=True) if not a.noise and not b.noise]
    assert any(a.annotator != b.annotator for a, b in both_sent)  # another crowd worker took the instruction
    assert any(a.swapped != b.swapped for a, b in both_sent)  # shown in another order
    assert all(a.preference == b.preference == 2 for a, b in both_sent)  # ... and still unswapped correctly


def test_a_member_without_replicates_is_refused_for_replicate_k_only():
    p = pool([LegacyJudge()])
    assert [a.preference for a in p.annotate([Pair("i", "a", "b")])] in ([1], [2])
    with pytest.raises(UserError, match="cannot draw replicate annotations"):
        p.annotate([Pair("i", "a", "b")], replicate=1)
    with pytest.raises(UserError, match="replicate must be an integer >= 0"):
        p.annotate([Pair("i", "a", "b")], replicate=-1)
