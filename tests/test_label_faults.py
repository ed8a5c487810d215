"""The label server at scale and on a bad disk (issue 61, cases 8 and 10).

Scale: serving costs the same number of SQLite steps at 200 or 20,000 pairs (an indexed query, no scan), and 50
clients at once on 100,000 pairs get no 500. Disk: a full disk (the server runs under ``RLIMIT_FSIZE``, so
SQLite's writes really fail) is a JSON 503 naming the store and one line in the log, no traceback; a store on a
read-only file system (a tmpfs remounted read-only; skipped where this cannot mount) is refused by ``serve`` at
start in one line naming the path and the cause, and still read by ``export``.
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_cli
from label_session import call, next_pair, serving

from alpacafarm_validation import label_store
from alpacafarm_validation.label_pairs import LabelPair
from alpacafarm_validation.label_store import LabelStore, Settings


def make_pairs(n: int) -> list[LabelPair]:
    return [LabelPair(f"Question {i}?", "", f"Answer A{i}.", f"A longer answer B{i}.", "ref", f"s{i % 4}")
            for i in range(n)]


def sqlite_steps(monkeypatch: pytest.MonkeyPatch, work) -> int:
    """SQLite virtual-machine steps (in units of 100) that ``work()`` costs, over every connection it opens."""
    steps = [0]
    real = sqlite3.connect

    def counting(*args, **kwargs):
        db = real(*args, **kwargs)
        db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1) or 0, 100)
        return db

    monkeypatch.setattr(label_store.sqlite3, "connect", counting)
    work()
    monkeypatch.setattr(label_store.sqlite3, "connect", real)
    return steps[0]


def test_serving_a_pair_costs_the_same_at_200_and_20000_pairs(tmp_path: Path, monkeypatch) -> None:
    costs = {}
    for n in (200, 20_000):
        store = LabelStore.create_or_resume(tmp_path / str(n), make_pairs(n), Settings(overlap=0.1))
        for who in ("ann", "bob"):  # some history, so the query has labels and leases to look past
            served = store.next_pair(who)
            store.record(who, served["pair_id"], served["ticket"], "first", "")

        def one_round(store: LabelStore = store) -> None:
            served = store.next_pair("cyd")
            store.record("cyd", served["pair_id"], served["ticket"], "first", "")

        costs[n] = sqlite_steps(monkeypatch, one_round)
    assert costs[20_000] < 3 * costs[200] + 50, costs  # a scan would cost ~100 times more


@pytest.mark.slow
def test_fifty_clients_at_once_on_100000_pairs_get_no_500(tmp_path: Path) -> None:
    """Before: ~0.4 s a request, and with 50 clients a quarter of the calls answered 500 "database is locked"."""
    folder = tmp_path / "session"
    LabelStore.create_or_resume(folder, make_pairs(100_000), Settings(overlap=0.1))
    statuses: list[int] = []
    with serving("--dir", str(folder), log=tmp_path / "server.log") as (url, _):
        def client(i: int) -> None:
            for _ in range(2):
                status, served = next_pair(url, f"client{i}")
                statuses.append(status)
                if status == 200 and not served["done"]:
                    statuses.append(call(url, "/api/label", {"labeller": f"client{i}", "pair_id": served["pair_id"],
                                                             "ticket": served["ticket"], "choice": "first"})[0])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    log = (tmp_path / "server.log").read_text()
    assert statuses.count(200) == len(statuses) == 200, sorted(set(statuses))
    assert "Traceback" not in log and "locked" not in log


def test_a_full_disk_is_a_json_503_and_one_line_in_the_log(tmp_path: Path) -> None:
    folder = tmp_path / "session"
    LabelStore.create_or_resume(folder, make_pairs(50), Settings(overlap=0.0))
    with sqlite3.connect(folder / "labels.sqlite") as db:  # merge the WAL, so the limit below is what is left
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    limit = max(f.stat().st_size for f in folder.iterdir()) + 48_000

    def small_disk() -> None:  # writes past the limit fail (EFBIG / a short write): SQLite sees a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    answers = []
    log = tmp_path / "server.log"
    with serving("--dir", str(folder), log=log, preexec=small_disk) as (url, _):
        for i in range(40):
            status, served = next_pair(url, f"p{i % 3}")
            answers.append((status, served))
            if status == 200:
                answers.append(call(url, "/api/label", {"labeller": f"p{i % 3}", "pair_id": served["pair_id"],
                                                        "ticket": served["ticket"], "choice": "first"}))
        assert call(url, "/static/label.js")[0] == 200  # the server still answers
    failed = [answer for status, answer in answers if status != 200]
    assert failed, "the limit never bit"
    assert {status for status, _ in answers} <= {200, 503}
    for answer in failed:
        assert isinstance(answer, dict) and str(folder / "labels.sqlite") in answer["error"], answer
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and str(folder / "labels.sqlite") in lines[0], text
    assert "Traceback" not in text


@pytest.fixture
def read_only_session(tmp_path: Path) -> Iterator[Path]:
    """A labelled session on a file system mounted read-only (a small tmpfs, remounted); skipped where this
    process cannot mount."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "none", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        folder = mount / "session"
        store = LabelStore.create_or_resume(folder, make_pairs(6), Settings(overlap=0.0))
        for who in ("ann", "bob"):
            served = store.next_pair(who)
            store.record(who, served["pair_id"], served["ticket"], "second", "")
        assert subprocess.run(["mount", "-o", "remount,ro", str(mount)]).returncode == 0
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_store_is_refused_at_start_naming_the_cause(read_only_session: Path) -> None:
    result = run_cli("label", "serve", "--dir", str(read_only_session), "--port", "0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert str(read_only_session / "labels.sqlite") in result.stderr and "read-only" in result.stderr
    assert "not a label store" not in result.stderr and "Traceback" not in result.stderr


def test_a_read_only_store_can_still_be_exported(read_only_session: Path, tmp_path: Path) -> None:
    out = tmp_path / "human.json"
    result = run_cli("label", "export", "--dir", str(read_only_session), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert [r["labeller"] for r in json.loads(out.read_text())] == ["ann", "bob"]


def test_chmod_read_only_store_is_refused_in_one_line(tmp_path: Path) -> None:
    """Without root: write permission taken away (as root, permissions do not bind: skipped)."""
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions; the read-only mount tests cover this")
    folder = tmp_path / "session"
    LabelStore.create_or_resume(folder, make_pairs(4), Settings())
    for path in [*folder.iterdir(), folder]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result = run_cli("label", "serve", "--dir", str(folder), "--port", "0")
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and "permission" in result.stderr
    finally:
        folder.chmod(0o755)
