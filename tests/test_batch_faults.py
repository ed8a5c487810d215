"""Batch files and batches a provider gets wrong (issue 61, cases 2, 6, 11 and 12), against a real local batch server
(:class:`batch_fault_server.FaultyBatchServer`) and, where processes matter, the real CLI in real processes: an
answer is never thrown away and bought again, a batch the provider forgot can be released (and only then), a
batch's cost is its submitter's, and batch ids are shown whole."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from annotator_server import TagResponder, tagged_pairs
from batch_fault_server import FaultyBatchServer
from conftest import run_cli
from test_annotation_reliability import annotate_process, cache_of, summary_of, write_pairs
from test_batch_annotation import BATCH_OPTIONS
from test_batch_annotation import judge as batch_judge

from alpacafarm.annotation_batches import BatchLedger
from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.testing.batch_server import BatchPlan

KEY = "local-faults-token-8Jk2Wq5Rn7Zd"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}


def error_line(result) -> str:
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    return line


# ------------------------------------------------------------------------------------------ case 2: listed twice
def test_an_answer_also_in_the_error_file_is_kept_and_never_bought_again(tmp_path: Path, monkeypatch, caplog):
    pairs, labels = tagged_pairs(3)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FaultyBatchServer(TagResponder(), listing="answered_and_failed") as server:
        annotations = batch_judge(server, cache, monkeypatch, batch_size=1).annotate(pairs)
        assert [a.preference for a in annotations] == labels
        assert server.created == 1 and set(server.executions.values()) == {1}  # nothing submitted again
    assert "is listed 2 times" in caplog.text and "the answer is kept" in caplog.text
    assert cache.ledger().requests == 3 and set(cache.paid_keys().values()) == {1}


def test_conflicting_answers_for_one_custom_id_are_neither_used_nor_bought_again(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(2)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FaultyBatchServer(TagResponder(), listing="twice_conflicting") as server:
        annotations = batch_judge(server, cache, monkeypatch, batch_size=1).annotate(pairs)
        assert server.created == 1  # not re-sent in this run
    first, second = annotations
    assert second.preference == labels[1]
    assert first.outcome == "unparsed" and "with different answers" in first.metadata["error"]
    assert "custom_id" in first.metadata["error"]
    ledger = cache.ledger()  # both copies were billed: both are booked, neither pair is counted as paid twice
    assert ledger.requests == 3 and sum(server.executions.values()) == 3
    assert set(cache.paid_keys().values()) == {1}


def test_the_same_answer_listed_twice_is_used_once_and_booked_twice(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(2)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FaultyBatchServer(TagResponder(), listing="twice_same") as server:
        annotations = batch_judge(server, cache, monkeypatch, batch_size=1).annotate(pairs)
        assert [a.preference for a in annotations] == labels and server.created == 1
    assert cache.ledger().requests == 3 == sum(server.executions.values())


# ------------------------------------------------------------------------------------------ case 6: forgotten
def _pending_batch(server: FaultyBatchServer, source: Path, tmp_path: Path, env: dict[str, str]) -> str:
    server.plan(BatchPlan(delay_s=float("inf")))
    pending = run_cli("annotate", str(source), "--annotator", "gpt4_b1_noex", "--base-url", server.base_url,
                      "-o", str(tmp_path / "a.json"), *BATCH_OPTIONS, "--set", "batch_wait_s=0", env=env)
    assert pending.returncode == 75, pending.stderr
    (batch_id,) = server.batches
    return batch_id


@pytest.mark.parametrize("lost", ["batch", "output file"])
def test_a_batch_the_provider_forgot_is_named_with_the_way_out_and_forgetting_it_frees_its_pairs(
        tmp_path: Path, env, lost: str):
    pairs, labels = tagged_pairs(3)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder()) as server:
        batch_id = _pending_batch(server, source, tmp_path, env)
        base = ["--annotator", "gpt4_b1_noex", "--base-url", server.base_url, *BATCH_OPTIONS]
        refused = run_cli("annotate", *base, "--batch-forget", batch_id, env=env)  # the provider still has it
        assert refused.returncode == 2 and "still knows batch" in error_line(refused), refused.stderr
        server.forget(batch_id) if lost == "batch" else server.lose_output(batch_id)
        again = run_cli("annotate", str(source), *base, "-o", str(tmp_path / "b.json"), env=env)
        assert again.returncode == 2, again.stderr
        line = error_line(again)
        assert f"--batch-forget {batch_id}" in line and "<redacted>" not in line  # the id whole, to copy
        assert "no longer knows" in line and "HTTP 404" in line and "Traceback" not in again.stderr
        if lost == "batch":
            cancel = run_cli("annotate", *base, "--batch-cancel", batch_id, env=env)
            assert cancel.returncode == 2 and f"--batch-forget {batch_id}" in error_line(cancel)
            live = run_cli("annotate", str(source), "--annotator", "gpt4_b1_noex", "--base-url", server.base_url,
                           "-o", str(tmp_path / "live.json"), env=env)
            assert live.returncode == 1
            assert f"--batch-forget {batch_id}" in json.loads((tmp_path / "live.json").read_text())[0]["error"]
        forget = run_cli("annotate", *base, "--batch-forget", batch_id, env=env)
        assert forget.returncode == 0, forget.stderr
        assert "nothing is booked in the ledger" in forget.stdout and "free again" in forget.stdout
        assert json.loads(forget.stdout.strip().splitlines()[-1])["forgotten"][0]["batch"] == batch_id
        assert BatchLedger(cache_of(env)).batches() == [] and cache_of(env).ledger().requests == 0
        final = run_cli("annotate", str(source), *base, "-o", str(tmp_path / "c.json"), env=env)
        assert final.returncode == 0, final.stderr
        assert server.created == 2
    assert [r["preference"] for r in json.loads((tmp_path / "c.json").read_text())] == labels


# ------------------------------------------------------------------------------------------ case 11: whose cost
def test_a_batch_collected_by_another_process_is_counted_by_the_one_that_submitted_it(tmp_path: Path, env):
    pairs, labels = tagged_pairs(4)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(delay_s=float("inf")))
        submitter = annotate_process(source, tmp_path / "a.json", server.base_url, env, "--set", "mode=batch",
                                     "--set", "batch_poll_s=3", "--set", "batch_max_poll_s=3")
        deadline = time.monotonic() + 60
        while not server.batches and time.monotonic() < deadline:
            time.sleep(0.02)
        polls = lambda: sum(r.path.startswith("/v1/batches/") for r in server.requests)  # noqa: E731
        collector = annotate_process(source, tmp_path / "b.json", server.base_url, env, *BATCH_OPTIONS)
        seen = polls()
        while polls() < seen + 3 and time.monotonic() < deadline:  # both are waiting on the same batch
            time.sleep(0.02)
        server.finish()  # the collector, polling 20 times as often, books it
        outs = [p.communicate(timeout=120) for p in (submitter, collector)]
        assert submitter.returncode == collector.returncode == 0, outs
        assert server.created == 1
    mine, theirs = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert (mine["requests"], theirs["requests"]) == (4, 0) and theirs["cost_usd"] == 0
    assert mine["cost_usd"] == pytest.approx(cache_of(env).ledger().price_usd) and mine["cost_usd"] > 0
    for name in ("a", "b"):
        assert [r["preference"] for r in json.loads((tmp_path / f"{name}.json").read_text())] == labels


# ------------------------------------------------------------------------------------------ case 12: ids whole
def test_batch_status_shows_each_id_whole_and_it_can_be_copied_into_batch_cancel(tmp_path: Path, env):
    pairs, _ = tagged_pairs(2)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder()) as server:
        batch_id = _pending_batch(server, source, tmp_path, env)
        status = run_cli("annotate", "--batch-status", env={**env, "COLUMNS": "80"})
        assert status.returncode == 0, status.stderr
        (line,) = [x for x in status.stdout.splitlines() if x.startswith("batch ")]
        command = line.split("cancel: ", 1)[1].split()
        assert command[-1] == batch_id and command[:2] == ["alpacafarm", "annotate"]
        cancel = run_cli(*command[1:], "--base-url", server.base_url, *BATCH_OPTIONS, env=env)
        assert cancel.returncode == 0, cancel.stderr
        assert summary_of(cancel)["cancelled"][0]["batch"] == batch_id


def test_a_provider_error_about_a_batch_shows_the_batch_id_but_never_the_key(tmp_path: Path, env):
    pairs, _ = tagged_pairs(2)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder()) as server:
        batch_id = _pending_batch(server, source, tmp_path, env)
        server.forget(batch_id)
        result = run_cli("annotate", "--annotator", "gpt4_b1_noex", "--base-url", server.base_url,
                         *BATCH_OPTIONS, "--batch-cancel", batch_id, env=env)
    line = error_line(result)
    assert f"No batch {batch_id}" in line and "<redacted>" not in line and KEY not in result.stderr
