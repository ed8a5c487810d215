"""Batch annotation (``mode: batch``, issue 43) against a real batch server on 127.0.0.1 (``FakeBatchServer``: files
and batches endpoints, in-progress states, partial failures, expiry, cancellation, slow completion), with real
processes and kill -9 where processes matter: every pair is paid once (counted at the server), labels and request
bodies equal the live path's."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from annotator_server import AlpacaEvalTagResponder, TagResponder, tagged_pairs
from conftest import run_cli
from test_alpaca_eval_configs import ae, offline_tiktoken  # noqa: F401  (fixtures)
from test_annotation_reliability import annotate_process, cache_of, write_pairs

from alpacafarm.annotation import AnnotationPending
from alpacafarm.annotation_batches import BatchLedger, BatchRequest
from alpacafarm.annotation_cache import AnnotationCache, pair_key
from alpacafarm.testing.batch_server import BatchPlan, FakeBatchServer
from alpacafarm_annotators.config import PromptedAnnotatorConfig
from alpacafarm_annotators.endpoint_requests import BudgetExceeded
from alpacafarm_annotators.prompted import PromptedAnnotator

KEY = "local-batch-token-5Hq8Zr2Nw6Ty"
FAST = {"batch_poll_s": 0.05, "batch_max_poll_s": 0.2, "max_retries": 1, "retry_backoff_s": 0.01, "timeout_s": 10.0}
BATCH_OPTIONS = ["--set", "mode=batch", "--set", "batch_poll_s=0.05", "--set", "batch_max_poll_s=0.2"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}


def judge(server: FakeBatchServer, cache: AnnotationCache | None, monkeypatch, **overrides) -> PromptedAnnotator:
    monkeypatch.setenv("BATCH_TEST_KEY", KEY)
    config = {"model": "gpt-4-0314", "template": "ranking", "batch_size": 3, "base_url": server.base_url,
              "api_key_env": "BATCH_TEST_KEY", "mode": "batch", **FAST, **overrides}
    return PromptedAnnotator(PromptedAnnotatorConfig(**config), "batch_judge", cache=cache)


def chat_bodies(server: FakeBatchServer) -> list[dict]:
    return [r.body for r in server.requests if r.path == "/v1/chat/completions"]


def batch_bodies(server: FakeBatchServer) -> list[dict]:
    return [line["body"] for batch in server.batches.values() for line in batch["lines"]]


# ------------------------------------------------------------------------------------------ same as live, half price
def test_batch_labels_bodies_and_cache_keys_equal_the_live_path_at_the_batch_rate(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(7)
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(delay_s=0.5))  # a slow completion: validating, in_progress, ... then completed
        batch_cache, live_cache = AnnotationCache(tmp_path / "b.sqlite"), AnnotationCache(tmp_path / "l.sqlite")
        batched = judge(server, batch_cache, monkeypatch).annotate(pairs)
        polls = sum(r.path.startswith("/v1/batches/") for r in server.requests)
        live = judge(server, live_cache, monkeypatch, mode="live").annotate(pairs)
    assert [a.preference for a in batched] == [a.preference for a in live] == labels
    assert polls >= 2 and not chat_bodies(server)[3:]  # polled while in progress; the live run sent 3 requests
    # byte-identical bodies: each live request's body, as received, is a line's body in the uploaded batch file
    uploaded = b"".join(f["data"] for f in server.files.values() if f["purpose"] == "batch")
    live_raw = [r.raw for r in server.requests if r.path == "/v1/chat/completions"]
    assert len(live_raw) == 3 and all(b'"body":' + raw + b"}\n" in uploaded for raw in live_raw)
    assert sorted(map(json.dumps, batch_bodies(server))) == sorted(map(json.dumps, chat_bodies(server)))
    keys = {r[0] for r in sqlite3.connect(tmp_path / "b.sqlite").execute("SELECT key FROM annotations")}
    assert keys == {r[0] for r in sqlite3.connect(tmp_path / "l.sqlite").execute("SELECT key FROM annotations")}
    # the price table's batch rate for gpt-4-0314 is half its list price: the same tokens cost half
    batch_ledger, live_ledger = batch_cache.ledger(), live_cache.ledger()
    assert (batch_ledger.requests, batch_ledger.tokens_in) == (live_ledger.requests, live_ledger.tokens_in) == (3, 1553)
    assert batch_ledger.price_usd == pytest.approx(live_ledger.price_usd / 2) and batch_ledger.price_usd > 0
    assert max(server.executions.values()) == 1 and server.created == 1
    assert BatchLedger(batch_cache).batches() == []  # collected: nothing pending


def test_a_second_run_is_served_from_the_cache_and_submits_nothing(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(4)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        judge(server, cache, monkeypatch).annotate(pairs)
        sent = len(server.requests)
        again = judge(server, cache, monkeypatch).annotate(pairs)
        assert [a.preference for a in again] == labels and all(a.cached for a in again)
        assert len(server.requests) == sent


# ------------------------------------------------------------------------------------------ partial results
def test_failed_expired_and_partly_failed_batches_resubmit_only_the_pairs_without_an_answer(tmp_path: Path,
                                                                                              monkeypatch):
    pairs, labels = tagged_pairs(4)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(outcome="failed"), BatchPlan(outcome="expired", answered=1),
                    BatchPlan(fail_lines=1), BatchPlan())
        annotations = judge(server, cache, monkeypatch, batch_size=1, batch_resubmits=3).annotate(pairs)
        assert [a.preference for a in annotations] == labels
        assert [len(b["lines"]) for b in server.batches.values()] == [4, 4, 3, 1]  # only what had no answer
        assert set(server.executions.values()) == {1} and len(server.executions) == 4
    assert cache.ledger().requests == 4 and set(cache.paid_keys().values()) == {1}


def test_a_pair_the_batch_keeps_failing_fails_after_batch_resubmits_and_a_rerun_submits_it_again(tmp_path: Path,
                                                                                                 monkeypatch):
    pairs, labels = tagged_pairs(2)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(fail_lines=1), BatchPlan(fail_lines=1))
        annotations = judge(server, cache, monkeypatch, batch_size=1, batch_resubmits=1).annotate(pairs)
        assert [a.outcome for a in annotations] == ["labelled", "failed"]
        error = annotations[1].metadata["error"]
        assert "HTTP 500" in error and "submitted 2 times" in error
        again = judge(server, cache, monkeypatch, batch_size=1).annotate(pairs)
        assert [a.preference for a in again] == labels and server.created == 3
        assert set(server.executions.values()) == {1}


def test_an_unreadable_batched_answer_is_asked_again_pair_by_pair(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(3)
    responder = TagResponder()
    responder.wrong_count_left = 1  # the 3-pair answer leaves one out
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(responder) as server:
        annotations = judge(server, cache, monkeypatch).annotate(pairs)
        assert [a.preference for a in annotations] == labels
        assert [len(b["lines"]) for b in server.batches.values()] == [1, 3]
    assert cache.ledger().requests == 4 and cache.paid_keys() == {k: 1 for k in cache.paid_keys()}


# ------------------------------------------------------------------------------------------ money
def test_a_batch_whose_worst_case_exceeds_the_budget_is_refused_before_anything_is_sent(tmp_path: Path,
                                                                                        monkeypatch):
    pairs, _ = tagged_pairs(6)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        with pytest.raises(BudgetExceeded, match=r"max_cost_usd=0\.0100"):
            judge(server, cache, monkeypatch, max_cost_usd=0.01).annotate(pairs)
        assert server.requests == [] and server.files == {}
    assert BatchLedger(cache).batches(open_only=False) == [] and cache.claims() == []


def test_a_live_run_fails_fast_on_pairs_in_a_pending_batch_and_pays_nothing_for_them(tmp_path: Path, monkeypatch):
    pairs, _ = tagged_pairs(2)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(delay_s=float("inf")))
        with pytest.raises(AnnotationPending, match=r"batch pending, re-run to collect: 2 pair\(s\) in 1 batch"):
            judge(server, cache, monkeypatch, batch_wait_s=0).annotate(pairs)
        live = judge(server, cache, monkeypatch, mode="live").annotate(pairs)
        assert {a.outcome for a in live} == {"failed"} and chat_bodies(server) == []
        assert "is in batch batch_" in live[0].metadata["error"] and "--batch-cancel" in live[0].metadata["error"]


def test_mode_batch_needs_the_cache_and_a_batch_price(tmp_path: Path, monkeypatch):
    from alpacafarm.errors import UserError

    with FakeBatchServer() as server:
        with pytest.raises(UserError, match="mode: batch needs the annotation cache"):
            PromptedAnnotator(PromptedAnnotatorConfig(model="gpt-4-0314", template="ranking", mode="batch",
                                                      cache=False), "no_cache")
        with pytest.raises(UserError, match=r"batch rate of model 'gpt-4-0314'.*price\.batch_input"):
            judge(server, AnnotationCache(tmp_path / "c.sqlite"), monkeypatch, price={"input": 1, "output": 1})


# ------------------------------------------------------------------------------------------ exactly once, processes
def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("created_at_provider", [True, False], ids=["adopted", "abandoned"])
def test_a_batch_recorded_by_a_process_killed_before_it_heard_back_is_adopted_or_abandoned(
        tmp_path: Path, monkeypatch, created_at_provider: bool):
    """The window between recording a batch and learning its provider id: the record carries a local id that the
    batch's metadata repeats, so the next run finds the batch (never submitting it again) or knows it never was."""
    import openai

    pairs, labels = tagged_pairs(3)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        annotator = judge(server, cache, monkeypatch, batch_size=1)
        keys = [pair_key(annotator.fingerprint, p) for p in pairs]
        owner = "killed-run:0"
        cache.claim(keys, owner)
        ledger = BatchLedger(cache)
        requests = [BatchRequest(f"old-{i}", [k], "sha") for i, k in enumerate(keys)]
        ledger.open("local-1", annotator=annotator.name, model=annotator.model, endpoint=annotator.endpoint,
                    requests=requests, max_cost_usd=1.0, owner=owner, run=None, stale_after_s=120)
        with cache.transaction() as db:  # its submitter died (kill -9) before recording the provider's answer
            db.execute("UPDATE batches SET pid = ? WHERE id = 'local-1'", (dead_pid(),))
        if created_at_provider:
            client = openai.OpenAI(api_key=KEY, base_url=server.base_url, max_retries=0)
            shown = ["[[p0:good]] [[p0:bad]]", "[[p1:bad]] [[p1:good]]"]  # what TagResponder reads
            lines = [{"custom_id": f"old-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "gpt-4-0314", "messages": [{"role": "user", "content": text}]}}
                     for i, text in enumerate(shown)]
            file = client.files.create(file=("f.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                       purpose="batch")
            client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"alpacafarm_batch": "local-1"})
        annotations = annotator.annotate(pairs)
        assert [a.preference for a in annotations] == labels
        record = ledger.get("local-1")
        if created_at_provider:  # adopted: its two answered lines are booked, only the third pair is sent anew
            assert record.state == "collected" and record.remote_id is not None
            assert server.created == 2 and [len(b["lines"]) for b in server.batches.values()] == [2, 1]
        else:  # never created: closed at no cost, its pairs submitted once
            assert record.state == "abandoned" and record.cost_usd == 0 and server.created == 1
        assert set(server.executions.values()) == {1} and set(cache.paid_keys().values()) == {1}


def test_a_create_that_timed_out_after_creating_the_batch_is_adopted_never_created_twice(tmp_path: Path,
                                                                                         monkeypatch):
    pairs, labels = tagged_pairs(3)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeBatchServer(TagResponder()) as server:
        server.create_delays.append(3.0)  # created at once, answered after the client's timeout
        annotations = judge(server, cache, monkeypatch, timeout_s=1.0, max_retries=2).annotate(pairs)
        assert [a.preference for a in annotations] == labels
        assert server.created == 1 and set(server.executions.values()) == {1}
    (record,) = BatchLedger(cache).batches(open_only=False)
    assert record.state == "collected" and record.remote_id in server.batches


def test_kill_9_while_pending_resumes_by_polling_the_same_batch_and_pays_every_pair_once(tmp_path: Path, env):
    pairs, labels = tagged_pairs(5)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(delay_s=float("inf")))
        first = annotate_process(source, tmp_path / "first.json", server.base_url, env, *BATCH_OPTIONS)
        deadline = time.monotonic() + 60
        while not any(r.path.startswith("/v1/batches/") for r in server.requests) and time.monotonic() < deadline:
            time.sleep(0.02)  # submitted and polled at least once: it is pending
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=30)
        status = run_cli("annotate", "--batch-status", env=env)
        assert status.returncode == 0, status.stderr
        listed = json.loads(status.stdout.strip().splitlines()[-1])
        assert listed["pending"] == 1 and listed["pairs"] == 5 and listed["max_cost_usd"] > 0
        assert listed["batches"][0]["remote_id"] in server.batches and "in_progress" in status.stdout
        server.finish()
        second = annotate_process(source, tmp_path / "second.json", server.base_url, env, *BATCH_OPTIONS)
        _, stderr = second.communicate(timeout=120)
        assert second.returncode == 0, stderr
        assert server.created == 1 and chat_bodies(server) == []  # resumed the same batch, submitted nothing again
        assert sum(server.submitted.values()) == 5 and set(server.executions.values()) == {1}
    assert [r["preference"] for r in json.loads((tmp_path / "second.json").read_text())] == labels
    assert set(cache_of(env).paid_keys().values()) == {1} and cache_of(env).ledger().requests == 5
    assert not any(KEY.encode() in f.read_bytes() for f in Path(env["ALPACAFARM_CACHE_DIR"]).iterdir())


def test_two_processes_never_submit_the_same_pair(tmp_path: Path, env):
    pairs, labels = tagged_pairs(6)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(delay_s=0.3), BatchPlan(delay_s=0.3))
        processes = [annotate_process(source, tmp_path / f"out{k}.json", server.base_url, env, *BATCH_OPTIONS)
                     for k in range(2)]
        for process in processes:
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr
        assert set(server.submitted.values()) == {1} and len(server.submitted) == 6  # each pair in one batch
        assert set(server.executions.values()) == {1}
    for k in range(2):
        assert [r["preference"] for r in json.loads((tmp_path / f"out{k}.json").read_text())] == labels
    assert set(cache_of(env).paid_keys().values()) == {1}


def test_pending_exits_75_then_cancel_books_the_answered_pairs_and_a_rerun_submits_only_the_rest(tmp_path: Path,
                                                                                                 env, monkeypatch):
    from alpacafarm.plugins import get_registry

    pairs, labels = tagged_pairs(4)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FakeBatchServer(TagResponder()) as server:
        server.plan(BatchPlan(delay_s=float("inf"), answered=2))
        base = ["--annotator", "gpt4_b1_noex", "--base-url", server.base_url, *BATCH_OPTIONS]
        pending = run_cli("annotate", str(source), *base, "-o", str(tmp_path / "a.json"), "--set", "batch_wait_s=0",
                          env=env)
        assert pending.returncode == 75, pending.stderr
        (error,) = [line for line in pending.stderr.splitlines() if line.startswith("error:")]  # one line
        assert "batch pending, re-run to collect: 4 pair(s)" in error and not (tmp_path / "a.json").exists()
        cancel = run_cli("annotate", *base, "--batch-cancel", env=env)
        assert cancel.returncode == 0, cancel.stderr
        assert json.loads(cancel.stdout.strip().splitlines()[-1])["cancelled"][0]["state"] == "cancelled"
        cache = cache_of(env)
        assert cache.ledger().requests == 2  # what it had answered before the cancel is booked
        assert BatchLedger(cache).batches() == []  # nothing pending any more
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        annotator = get_registry().create("annotator", "gpt4_b1_noex", {"base_url": server.base_url, "mode": "batch",
                                                                        **FAST})
        assert [a.preference for a in annotator.annotate(pairs)] == labels
        assert [len(b["lines"]) for b in server.batches.values()] == [4, 2]  # only the pairs without an answer
        assert set(server.executions.values()) == {1} and KEY not in json.dumps(server.batches, default=str)


def test_an_alpaca_eval_config_in_batch_mode_gives_the_live_labels_at_half_the_price(ae, offline_tiktoken,  # noqa: F811
                                                                                    tmp_path: Path, monkeypatch):
    from alpacafarm.plugins import get_registry
    from alpacafarm_annotators.alpaca_eval_source import load_members

    pairs, labels = tagged_pairs(7)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    ledgers = {}
    with FakeBatchServer(AlpacaEvalTagResponder(load_members("alpaca_farm_greedy_gpt4"))) as server:
        for mode in ("live", "batch"):
            cache = AnnotationCache(tmp_path / f"{mode}.sqlite")
            pool = get_registry().create("annotator", "alpaca_eval:alpaca_farm_greedy_gpt4",
                                         {"overrides": {"base_url": server.base_url, "mode": mode, **FAST}},
                                         cache=cache)
            assert [a.preference for a in pool.annotate(pairs)] == labels
            ledgers[mode] = cache.ledger()
        assert server.created == 1 and len(batch_bodies(server)) == 2  # 7 pairs in batches of 5, as live
        assert sorted(map(json.dumps, batch_bodies(server))) == sorted(map(json.dumps, chat_bodies(server)))
    assert ledgers["batch"].price_usd == pytest.approx(ledgers["live"].price_usd / 2) and ledgers["batch"].price_usd > 0


# ------------------------------------------------------------------------------------------ caches, recipes
def test_a_cache_written_before_batches_existed_gets_the_batch_tables(tmp_path: Path, monkeypatch):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE annotations (key TEXT PRIMARY KEY, annotator TEXT NOT NULL, preference INTEGER, "
                     "raw_completion TEXT, tokens_in INTEGER NOT NULL, tokens_out INTEGER NOT NULL, price_usd REAL "
                     "NOT NULL, latency_s REAL NOT NULL, request_id TEXT, created REAL NOT NULL);")
    db.close()
    pairs, labels = tagged_pairs(2)
    with FakeBatchServer(TagResponder()) as server:
        assert [a.preference for a in judge(server, AnnotationCache(path), monkeypatch).annotate(pairs)] == labels
    assert {"batches", "batch_requests", "batch_pairs"} <= {
        r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_an_evaluation_stage_exits_pending_and_a_rerun_collects_the_same_batch(tmp_path: Path, register_test_plugin,
                                                                                monkeypatch):
    from test_evaluation import OutputsPlugin

    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe

    register_test_plugin(OutputsPlugin(), "evaluation-test")
    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    with FakeBatchServer(lambda body: "Output (2)") as server:
        server.plan(BatchPlan(delay_s=float("inf")))
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(
            "name: eval-toy\nstages:\n  - name: policy\n    method: write_truncated_outputs\n"
            "evaluation:\n  evaluator: win_rate\n  config: {max_instructions: 6}\n  annotator:\n"
            "    name: gpt4_b1_noex\n"
            f"    config: {{base_url: '{server.base_url}', api_key_env: null, mode: batch, batch_wait_s: 0}}\n")
        run_dir = tmp_path / "run"
        with pytest.raises(AnnotationPending, match="batch pending, re-run to collect"):
            Pipeline(load_recipe(recipe), get_registry(), run_dir).run()
        manifest = run_dir / "stages" / "evaluate" / "manifest.json"
        assert not manifest.exists() or json.loads(manifest.read_text())["status"] != "complete"
        server.finish()
        outcomes = {o.name: o for o in Pipeline(load_recipe(recipe), get_registry(), run_dir).run()}
        assert outcomes["evaluate"].status == "ran" and json.loads(manifest.read_text())["status"] == "complete"
        assert server.created == 1 and set(server.executions.values()) == {1}
        assert outcomes["evaluate"].artifact.metadata["n_failed"] == 0



def test_an_endpoint_without_batches_fails_in_one_line_and_leaves_the_pairs_free_for_a_live_run(tmp_path: Path,
                                                                                                 monkeypatch):
    from alpacafarm.errors import UserError
    from alpacafarm.testing.openai_server import FakeOpenAIServer

    pairs, labels = tagged_pairs(2)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeOpenAIServer(TagResponder()) as server:  # chat completions only: /v1/files is a 404
        with pytest.raises(UserError, match=r"127\.0\.0\.1.*refused to upload the batch file \(404\)"):
            judge(server, cache, monkeypatch).annotate(pairs)
        (record,) = BatchLedger(cache).batches(open_only=False)
        assert record.state == "abandoned" and cache.claims() == []
        live = judge(server, cache, monkeypatch, mode="live").annotate(pairs)
        assert [a.preference for a in live] == labels
