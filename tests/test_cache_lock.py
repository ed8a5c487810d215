"""A cache locked by another program fails within a documented, configurable bound, naming that program
(issue 41, case 9): SQLite's own wait was 60 s per operation (121 s before the one-line error)."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
from annotator_server import tagged_pairs
from conftest import run_cli
from test_annotation_reliability import write_pairs

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.errors import UserError
from alpacafarm.processes import DEFAULT_LOCK_TIMEOUT_S, LOCK_TIMEOUT_ENV, lock_timeout_s


def test_the_default_bound_is_a_few_seconds_and_a_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(LOCK_TIMEOUT_ENV, raising=False)
    assert lock_timeout_s() == DEFAULT_LOCK_TIMEOUT_S <= 10
    for bad in ("nan", "-1", "inf", "soon"):
        monkeypatch.setenv(LOCK_TIMEOUT_ENV, bad)
        with pytest.raises(UserError, match=LOCK_TIMEOUT_ENV):
            lock_timeout_s()


def test_a_locked_cache_fails_within_the_bound_naming_the_holder(tmp_path: Path):
    cache_dir = tmp_path / "cache"
    cache = AnnotationCache(cache_dir / "annotations.sqlite")
    other = sqlite3.connect(cache.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # e.g. a sqlite3 shell left in a transaction: this very process
    pairs, _ = tagged_pairs(1)
    try:
        started = time.monotonic()
        result = run_cli("annotate", str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                         "--base-url", "http://127.0.0.1:9/v1", "-o", str(tmp_path / "out.json"),
                         env={"ALPACAFARM_CACHE_DIR": str(cache_dir), LOCK_TIMEOUT_ENV: "1",
                              "OPENAI_API_KEY": "sk-test-lock"})
        elapsed = time.monotonic() - started
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # (a progress bar above)
    assert len(lines) == 1 and str(cache.path) in lines[0] and "more than 1 s" in lines[0], lines
    assert f"pid {os.getpid()}" in lines[0]  # the program that holds it
    assert elapsed < 30  # process start and imports included; the wait itself is bounded by 1 s per operation


def test_a_fresh_cache_opens_while_another_connection_holds_its_write_lock(tmp_path: Path):
    """Two processes opening a new cache together: the second's switch to WAL met the first's write lock and
    SQLite refused it at once (no busy wait where it could deadlock), 'locked for more than 5 s' after 2 ms."""
    import threading

    path = tmp_path / "annotations.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE first_writer (x)")  # the file exists, still in rollback mode
    holder.execute("BEGIN IMMEDIATE")  # the first opener, mid-write
    release = threading.Timer(0.5, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        cache = AnnotationCache(path)
    finally:
        release.join()
        holder.close()
    assert cache.connection().execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert cache.ledger().requests == 0  # the schema is there
