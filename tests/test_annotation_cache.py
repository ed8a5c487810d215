"""The SQLite annotation cache and ledger, including several processes writing at once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from alpacafarm.annotation_cache import AnnotationCache, pair_key
from alpacafarm.types import Annotation, Pair


def test_round_trip_and_ledger(tmp_path: Path):
    cache = AnnotationCache(tmp_path / "c.sqlite")
    pairs = [Pair("i", "a", "b"), Pair("i", "a", "c"), Pair("j", "a", "b", input="x")]
    keys = [pair_key("fp", p) for p in pairs]
    assert len(set(keys)) == 3 and pair_key("other", pairs[0]) != keys[0]
    cache.record_batch("judge", "m", [(keys[0], Annotation(1, "judge", "raw", 10, 2, 0.5, 0.1)),
                                      (keys[1], Annotation(None, "judge", "raw", 10, 2, 0.5, 0.1))],
                       tokens_in=20, tokens_out=4, price_usd=1.0, latency_s=0.2, attempts=1, parsed=False)
    found = cache.get_many(keys)
    assert set(found) == {keys[0], keys[1]}
    assert found[keys[0]].preference == 1 and found[keys[0]].cached and found[keys[1]].preference is None
    totals = cache.ledger()
    assert (totals.requests, totals.tokens_in, totals.tokens_out, totals.price_usd) == (1, 20, 4, 1.0)
    assert cache.ledger(annotator="nobody").requests == 0


def _writer(path: str, worker: int, n: int) -> None:
    cache = AnnotationCache(path)
    for i in range(n):
        key = pair_key("fp", Pair(f"w{worker}", str(i), "x"))
        cache.record_batch(f"w{worker}", "m", [(key, Annotation(1, f"w{worker}"))], tokens_in=1, tokens_out=1,
                           price_usd=0.001, latency_s=0.0, attempts=1, parsed=True)


def test_concurrent_writers_from_several_processes(tmp_path: Path):
    path = str(tmp_path / "shared.sqlite")
    AnnotationCache(path)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(path, w, 150)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    cache = AnnotationCache(path)
    assert cache.ledger().requests == 600
    keys = [pair_key("fp", Pair(f"w{w}", str(i), "x")) for w in range(4) for i in range(150)]
    assert len(cache.get_many(keys)) == 600


def test_replicate_zero_keeps_the_key_from_before_replicates_and_k_gets_its_own():
    pair = Pair("Name a colour.", "Red.", "Blue, obviously.", input="in")
    old = "e738c8d9e851c60ee39d8d166bcef1b37046787452edc85af1d16337ae0a0c10"  # pair_key("fp", pair) before replicates
    assert pair_key("fp", pair) == pair_key("fp", pair, 0) == old  # existing caches stay valid
    keys = {pair_key("fp", pair, k) for k in range(1, 5)}
    assert len(keys) == 4 and old not in keys
