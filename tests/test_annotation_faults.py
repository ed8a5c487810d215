"""Hangs, double pay, budget bypass, lost answers and key leaks of the annotation path (issue 27), each against a
real local server (``FakeOpenAIServer`` fault modes) and, where processes matter, real processes and signals."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from annotator_server import TagResponder, tagged_pairs
from conftest import run_cli
from test_annotation_reliability import annotate_process, cache_of, judge, write_pairs

from alpacafarm.annotation_cache import AnnotationCache, CacheError
from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault

# Not in any known key format: only redaction of the very key the client holds can hide it.
PLAIN_KEY = "local-gateway-token-7Qx2Lm9Pz4Kw8Rt1"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": PLAIN_KEY, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}


# ------------------------------------------------------------------------------------------------------- hangs
@pytest.mark.parametrize("retry_after", [86400.0, math.inf, math.nan], ids=["a-day", "inf", "nan"])
def test_an_unbounded_retry_after_is_capped_by_max_backoff_s(tmp_path: Path, monkeypatch, retry_after: float):
    pairs, labels = tagged_pairs(1)
    with FakeOpenAIServer(TagResponder()) as server:
        server.script(Fault("429", retry_after=retry_after))
        started = time.monotonic()
        annotator = judge(server, AnnotationCache(tmp_path / "c.sqlite"), monkeypatch, max_backoff_s=0.2)
        annotations = annotator.annotate(pairs)
        assert time.monotonic() - started < 5
        assert [a.preference for a in annotations] == labels and len(server.requests) == 2


def test_a_trickled_body_ends_at_the_request_deadline(tmp_path: Path, monkeypatch):
    pairs, _ = tagged_pairs(1)
    with FakeOpenAIServer(lambda body: Fault("trickle", seconds=30)) as server:  # a byte every 0.1 s, 30 s long
        started = time.monotonic()
        annotator = judge(server, AnnotationCache(tmp_path / "c.sqlite"), monkeypatch, timeout_s=1.0,
                          max_retries=6, retry_backoff_s=0.01)
        (annotation,) = annotator.annotate(pairs)
        assert time.monotonic() - started < 8  # timeout_s is the whole request's deadline, not each read's
        assert annotation.outcome == "failed" and "Timeout after 2 attempts" in annotation.metadata["error"]
        assert len(server.requests) == 2  # timeout_retries=1


def test_a_stalled_endpoint_fails_fast_with_the_default_retries(tmp_path: Path, monkeypatch):
    pairs, _ = tagged_pairs(4)
    with FakeOpenAIServer(lambda body: Fault("hang", seconds=30)) as server:
        started = time.monotonic()
        annotator = judge(server, AnnotationCache(tmp_path / "c.sqlite"), monkeypatch, batch_size=1, timeout_s=0.5,
                          max_retries=6, retry_backoff_s=1.0)  # the defaults, but for a short timeout
        annotations = annotator.annotate(pairs)
        assert {a.outcome for a in annotations} == {"failed"}
        assert len(server.requests) <= 4 * 2  # each in-flight request tried twice at most (was 4 x 7 = 28)
        assert time.monotonic() - started < 10


# ------------------------------------------------------------------------------------------------------- money
def test_a_paused_owner_whose_claims_were_taken_over_never_pays_for_them(tmp_path: Path, env):
    pairs, labels = tagged_pairs(6)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    options = ["--set", "max_concurrency=1", "--set", "claim_stale_s=1", "--set", "claim_poll_s=0.1",
               "--set", "timeout_s=60"]
    with FakeOpenAIServer(TagResponder(), latency_s=0.3) as server:
        first = annotate_process(source, tmp_path / "first.json", server.base_url, env, *options)
        deadline = time.monotonic() + 60
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)  # Ctrl-Z with one request in flight
        try:
            time.sleep(1.5)  # longer than claim_stale_s: its heartbeat is stale, its claims are taken over
            second = annotate_process(source, tmp_path / "second.json", server.base_url, env, *options)
            _, stderr = second.communicate(timeout=120)
            assert second.returncode == 0, stderr
            sent = len(server.requests)
            assert sent == 1 + 6  # the paused process's request in flight, then every pair once
        finally:
            os.kill(first.pid, signal.SIGCONT)
        _, stderr = first.communicate(timeout=120)
        assert first.returncode == 0, stderr
        assert len(server.requests) == sent  # resumed, it sends nothing: it waits for the other's answers
    for name in ("first", "second"):
        assert [r["preference"] for r in json.loads((tmp_path / f"{name}.json").read_text())] == labels
    paid = cache_of(env).paid_keys()
    assert sum(n > 1 for n in paid.values()) <= 1  # at most the one request that was in flight at the pause


def test_a_server_without_usage_is_counted_and_stopped_at_the_budget(tmp_path: Path, env):
    pairs, _ = tagged_pairs(40)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FakeOpenAIServer(TagResponder(), usage=False) as server:
        result = run_cli("annotate", str(source), "--annotator", "gpt4_b1_noex", "--base-url", server.base_url,
                         "--max-cost-usd", "0.05", "--set", "price={input: 10.0, output: 30.0}",
                         "--set", "max_concurrency=1", "-o", str(tmp_path / "out.json"), env=env)
        sent = len(server.requests)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "max_cost_usd=0.0500" in errors[0], result.stderr
    assert result.stderr.count("sent no token usage") == 1  # said once
    ledger = cache_of(env).ledger()
    assert 0 < ledger.price_usd <= 0.05 and ledger.requests == sent < 40
    rows = json.loads((tmp_path / "out.json").read_text())  # what was paid for is written out, the rest says why
    assert sum(r["outcome"] == "labelled" for r in rows) == sent
    assert all("budget" in r["error"] for r in rows if r["outcome"] == "failed")


class PaddedResponder(TagResponder):
    """Right answers with 8 KB of reasoning after them: each stored answer needs new database pages."""

    def __call__(self, body: dict) -> str | Fault:
        return f"{super().__call__(body)}\nReasoning: {'x' * 8000}"


def fill_up(cache: AnnotationCache) -> None:
    """The cache's disk is full from now on: SQLite refuses every new page ("database or disk is full")."""
    db = cache._connect()
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")


def test_a_full_disk_keeps_the_paid_answer_and_sends_nothing_more(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(6)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    fill_up(cache)
    with FakeOpenAIServer(PaddedResponder()) as server:
        annotator = judge(server, cache, monkeypatch, batch_size=1, max_concurrency=1, cache_flush_wait_s=0.3)
        with pytest.raises(CacheError) as caught:
            annotator.annotate(pairs)
        assert len(server.requests) == 1  # the answer could not be stored: nothing more is bought
    message = str(caught.value)
    assert "database or disk is full" in message and "1 paid answer(s) could not be stored" in message
    assert str(cache.path) in message and "\n" not in message
    partial = caught.value.partial  # the paid answer is still handed back to the caller
    assert partial[0].preference == labels[0] and {a.outcome for a in partial[1:]} == {"failed"}


def test_space_freed_while_retrying_stores_the_held_answer_and_nothing_is_paid_twice(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(6)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    fill_up(cache)

    class FreeSpace(logging.Handler):  # the user frees space when told the answers are held
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying to store them" in record.getMessage():
                cache._connect().execute("PRAGMA max_page_count = 1000000")

    handler = FreeSpace()
    logging.getLogger("alpacafarm.annotators").addHandler(handler)
    try:
        with FakeOpenAIServer(PaddedResponder()) as server:
            annotator = judge(server, cache, monkeypatch, batch_size=1, max_concurrency=1, cache_flush_wait_s=5)
            with pytest.raises(CacheError) as caught:  # the call still stops: it sent nothing after the failure
                annotator.annotate(pairs)
            assert "could not be stored" not in str(caught.value) and len(server.requests) == 1
            again = judge(server, cache, monkeypatch, batch_size=1).annotate(pairs)
            assert [a.preference for a in again] == labels and len(server.requests) == 6
    finally:
        logging.getLogger("alpacafarm.annotators").removeHandler(handler)
    assert set(cache.paid_keys().values()) == {1}


def test_an_answer_cut_off_at_max_tokens_says_so_and_is_asked_again_on_a_later_run(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(1)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    responder = TagResponder()
    state = {"null": True}
    with FakeOpenAIServer(lambda body: Fault("null_content") if state["null"] else responder(body)) as server:
        (first,) = judge(server, cache, monkeypatch).annotate(pairs)
        assert first.outcome == "unparsed" and "cut off at max_tokens" in first.metadata["error"]
        state["null"] = False
        (second,) = judge(server, cache, monkeypatch).annotate(pairs)  # re-asked, as the message says
        assert second.preference == labels[0] and len(server.requests) == 3


def test_the_evaluate_message_says_what_a_rerun_asks_again():
    from alpacafarm.annotation import AnnotationFailed, check_unlabelled
    from alpacafarm.types import Annotation

    annotations = [Annotation(None, "j", outcome="unparsed", metadata={"error": "unparsed"}),
                   Annotation(None, "j", outcome="failed", metadata={"error": "boom"})]
    with pytest.raises(AnnotationFailed) as caught:
        check_unlabelled(annotations, 0.05, "evaluation")
    assert "failed pairs are asked again" in str(caught.value) and "reask_unparsed" in str(caught.value)


def test_a_reply_without_choices_fails_its_pairs_in_one_line(tmp_path: Path, env):
    pairs, _ = tagged_pairs(2)
    with FakeOpenAIServer(lambda body: Fault("no_choices")) as server:
        result = run_cli("annotate", str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                         "--base-url", server.base_url, "--set", "max_retries=1", "--set", "retry_backoff_s=0.01",
                         "-o", str(tmp_path / "out.json"), env=env)
        url = server.base_url
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no choices" in errors[0] and url in errors[0]


# ------------------------------------------------------------------------------------------------------ secrets
def test_a_key_echoed_by_the_endpoint_is_never_written(tmp_path: Path, env):
    pairs, _ = tagged_pairs(3)
    with FakeOpenAIServer(lambda body: Fault("echo_key")) as server:
        result = run_cli("annotate", str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                         "--base-url", server.base_url, "--set", "max_retries=1", "--set", "retry_backoff_s=0.01",
                         "-o", str(tmp_path / "out.json"), env=env)
        assert PLAIN_KEY in server.seen_api_keys()
    assert result.returncode == 1, result.stderr
    output = (tmp_path / "out.json").read_text()
    assert "while checking key <redacted>" in output  # the error is kept, the key is not
    for text in (result.stdout, result.stderr, output):
        assert PLAIN_KEY not in text
    assert json.loads(result.stdout.splitlines()[-1])["first_error"].count("<redacted>") == 1


# --------------------------------------------------------------------------------------------- a broken cache
@pytest.mark.parametrize("damage", ["truncated", "random", "directory"])
def test_a_broken_cache_file_is_one_line_naming_it(tmp_path: Path, env, damage: str):
    pairs, _ = tagged_pairs(1)
    path = Path(env["ALPACAFARM_CACHE_DIR"]) / "annotations.sqlite"
    cache = AnnotationCache(path)
    cache.close()
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3 or 50])
    elif damage == "random":
        path.write_bytes(os.urandom(8192))
    else:
        path.unlink()
        path.mkdir()
    result = run_cli("annotate", str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                     "--base-url", "http://127.0.0.1:9/v1", "-o", str(tmp_path / "out.json"), env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: annotation cache ") and str(path) in lines[0], lines


def test_a_read_only_cache_is_one_line_naming_it(tmp_path: Path, env):
    from test_user_errors import permission_checked

    prefix = permission_checked()
    pairs, _ = tagged_pairs(1)
    folder = Path(env["ALPACAFARM_CACHE_DIR"])
    AnnotationCache(folder / "annotations.sqlite").close()
    for path in (folder / "annotations.sqlite", folder):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result = subprocess.run([*prefix, os.sys.executable, "-m", "alpacafarm", "annotate",
                                 str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                                 "--base-url", "http://127.0.0.1:9/v1", "-o", str(tmp_path / "out.json")],
                                capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    finally:
        folder.chmod(0o755)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "annotation cache" in lines[0] and "read-only" in lines[0], lines


def test_a_cache_locked_by_another_program_is_one_line_naming_it(tmp_path: Path):
    import sqlite3

    cache = AnnotationCache(tmp_path / "c.sqlite")
    other = sqlite3.connect(cache.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # e.g. a sqlite3 shell left in a transaction
    try:
        cache._connect().execute("PRAGMA busy_timeout = 200")  # the real wait is 60 s
        with pytest.raises(CacheError) as caught:
            cache.claim(["k"], "owner")
    finally:
        other.execute("ROLLBACK")
        other.close()
    message = str(caught.value)
    assert str(cache.path) in message and "locked" in message and "another program" in message
