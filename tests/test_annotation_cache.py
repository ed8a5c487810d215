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


# --- claims: exactly-once payment across processes -----------------------------------------------------------------


def _hold_claims(path: str, keys: list[str], ready) -> None:
    import time

    AnnotationCache(path).claim(keys, "holder")
    ready.set()
    while True:  # alive, heartbeat never refreshed: live by its pid until the claim is stale
        time.sleep(1)


def test_a_live_claim_is_busy_a_killed_owners_claim_is_taken_over(tmp_path: Path):
    import os
    import signal

    path = str(tmp_path / "c.sqlite")
    keys = [pair_key("fp", Pair("q", str(i), "x")) for i in range(3)]
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold_claims, args=(path, keys, ready))
    holder.start()
    try:
        assert ready.wait(60)
        cache = AnnotationCache(path)
        claimed = cache.claim(keys, "me")
        assert claimed.mine == [] and set(claimed.busy) == set(keys) and f"pid {holder.pid}" in claimed.busy[keys[0]]
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        claimed = cache.claim(keys, "me")
        assert claimed.mine == keys and claimed.taken_over == 3 and claimed.busy == {}
        assert {c["owner"] for c in cache.claims()} == {"me"}
    finally:
        if holder.is_alive():
            holder.kill()


def test_claims_of_another_host_live_by_heartbeat_and_answers_release_them(tmp_path: Path):
    import sqlite3
    import time

    cache = AnnotationCache(tmp_path / "c.sqlite")
    keys = [pair_key("fp", Pair("q", str(i), "x")) for i in range(3)]
    with sqlite3.connect(cache.path) as db:
        db.execute("INSERT INTO claims VALUES (?,?,?,?,?,?)", (keys[0], "far", 1, "elsewhere", 0, time.time()))
        db.execute("INSERT INTO claims VALUES (?,?,?,?,?,?)", (keys[1], "far", 1, "elsewhere", 0, time.time() - 999))
    claimed = cache.claim(keys, "me", stale_after_s=60)
    assert list(claimed.busy) == [keys[0]] and claimed.mine == keys[1:] and claimed.taken_over == 1
    cache.record_batch("judge", "m", [(keys[1], Annotation(2, "judge"))], tokens_in=1, tokens_out=1, price_usd=0.1,
                       latency_s=0.0, attempts=1, parsed=True, owner="me")
    assert sorted(c["key"] for c in cache.claims()) == sorted([keys[0], keys[2]])  # the answer released its claim
    assert cache.claim([keys[1]], "other").done == [keys[1]]  # answered: nobody pays for it again
    cache.release("me")
    assert [c["key"] for c in cache.claims()] == [keys[0]]
    assert cache.paid_keys() == {keys[1]: 1}
