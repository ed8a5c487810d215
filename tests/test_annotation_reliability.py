"""Fail loudly, lose nothing, never pay twice: the annotation path against a real local server, real processes and
real kills (issue 13). Outcomes (labelled, tie, unparsed, failed), failures never cached, pair-by-pair re-asks of
an unreadable batch, claims shared by concurrent processes and taken over from killed ones, and a preference stage
that refuses to be "complete" with holes."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from annotator_server import TagResponder, tagged_pairs
from conftest import REPO_ROOT, run_cli

from alpacafarm.annotation_cache import AnnotationCache, pair_key
from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault
from alpacafarm.types import Pair
from alpacafarm_annotators.config import PromptedAnnotatorConfig
from alpacafarm_annotators.prompted import PromptedAnnotator

SECRET = "sk-live-SECRETKEY-reliability-0123456789"
FAST = ["--set", "max_retries=2", "--set", "retry_backoff_s=0.01", "--set", "timeout_s=2"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": SECRET, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}


def cache_of(env: dict[str, str]) -> AnnotationCache:
    return AnnotationCache(Path(env["ALPACAFARM_CACHE_DIR"]) / "annotations.sqlite")


def write_pairs(path: Path, pairs: list[Pair]) -> Path:
    path.write_text("".join(json.dumps({"instruction": p.instruction, "output_1": p.output_1,
                                        "output_2": p.output_2}) + "\n" for p in pairs))
    return path


def summary_of(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def closed_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------ a failed annotator fails
def test_a_closed_port_fails_in_seconds_with_exit_1_naming_the_endpoint(tmp_path: Path, env):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    pairs, _ = tagged_pairs(6)
    started = time.monotonic()
    result = run_cli("annotate", str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                     "--base-url", url, "-o", str(tmp_path / "out.json"), env=env)  # default retries and backoff
    assert time.monotonic() - started < 20
    assert result.returncode == 1, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and url in error[0] and "6 of 6 annotations failed" in error[0]
    assert "APIConnectionError" in error[0] and SECRET not in result.stdout + result.stderr
    summary = summary_of(result)
    assert (summary["failed"], summary["parsed"], summary["endpoint"], summary["requests"]) == (6, 0, url, 0)
    rows = json.loads((tmp_path / "out.json").read_text())
    assert all(r["outcome"] == "failed" and r["preference"] is None and r["error"] for r in rows)
    assert cache_of(env).get_many([pair_key("x", p) for p in pairs]) == {} and cache_of(env).ledger().requests == 0


@pytest.mark.parametrize("fault", [Fault("500"), Fault("429", retry_after=0.01), Fault("garbage")],
                         ids=["500", "429", "garbage"])
def test_an_endpoint_failing_every_time_exits_1_sends_little_and_a_rerun_asks_again(tmp_path: Path, env, fault):
    pairs, labels = tagged_pairs(12)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    responder = TagResponder()
    broken = {"on": True}
    with FakeOpenAIServer(lambda body: fault if broken["on"] else responder(body)) as server:
        args = ["annotate", str(source), "--annotator", "gpt4_b1_noex", "--base-url", server.base_url,
                "--set", "max_concurrency=2", *FAST]
        result = run_cli(*args, "-o", str(tmp_path / "out.json"), env=env)
        assert result.returncode == 1, result.stderr
        assert server.base_url in result.stderr and "12 of 12 annotations failed" in result.stderr
        assert summary_of(result)["failed"] == 12 and summary_of(result)["first_error"]
        # the breaker: the endpoint failed every request, so only the requests in flight retried (not 12 x 3)
        assert len(server.requests) <= 2 * 3
        broken["on"] = False  # the server recovers: nothing failed was cached, the re-run asks for all of it
        sent = len(server.requests)
        again = run_cli(*args, "-o", str(tmp_path / "again.json"), env=env)
        assert again.returncode == 0, again.stderr
        assert len(server.requests) - sent == 12 and summary_of(again)["requests"] == 12
    rows = json.loads((tmp_path / "again.json").read_text())
    assert [r["preference"] for r in rows] == labels and {r["outcome"] for r in rows} == {"labelled"}


# ------------------------------------------------------------------------------------ unreadable batches
class PoisonResponder(TagResponder):
    """Answers correctly, except that any request showing pair ``poison`` gets prose without a single verdict
    (for its first ``poison_left`` requests only, when that is set: a transient failure)."""

    def __init__(self, poison: int, poison_left: int | None = None) -> None:
        super().__init__()
        self.poison, self.poison_left = f"[[p{poison}:", poison_left

    def __call__(self, body: dict) -> str | Fault:
        from alpacafarm.testing.openai_server import request_text

        if self.poison in request_text(body) and (self.poison_left is None or self.poison_left > 0):
            if self.poison_left is not None:
                self.poison_left -= 1
            return "These answers are all quite good in their own way; I cannot decide."
        return super().__call__(body)


def judge(server: FakeOpenAIServer, cache: AnnotationCache, monkeypatch, **overrides) -> PromptedAnnotator:
    monkeypatch.setenv("TEST_JUDGE_KEY", SECRET)
    config = {"model": "gpt-4-0314", "template": "ranking", "batch_size": 5, "base_url": server.base_url,
              "api_key_env": "TEST_JUDGE_KEY", "max_retries": 2, "retry_backoff_s": 0.01, "timeout_s": 5.0,
              "price": {"input": 10.0, "output": 30.0}, **overrides}
    return PromptedAnnotator(PromptedAnnotatorConfig(**config), "test_judge", cache=cache)


def test_an_unreadable_batch_is_asked_pair_by_pair_and_never_poisons_its_neighbours(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(5)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeOpenAIServer(PoisonResponder(poison=2)) as server:
        annotations = judge(server, cache, monkeypatch).annotate(pairs)
        assert [a.preference for a in annotations] == [*labels[:2], None, *labels[3:]]  # the neighbours are kept
        assert [a.outcome for a in annotations] == ["labelled"] * 2 + ["unparsed"] + ["labelled"] * 2
        assert len(server.requests) == 2 + 4 + 2  # the batch twice, then each pair alone (the poisoned one twice)
        assert cache.ledger().requests == 8  # every paid completion is booked
        # a later run asks again for the pair given up as unparsed (reask_unparsed=1: once), alone, and only it
        again = judge(server, cache, monkeypatch).annotate(pairs)
        assert len(server.requests) == 8 + 2
        assert [a.preference for a in again] == [a.preference for a in annotations]
        assert [a.cached for a in again] == [True, True, False, True, True]
        third = judge(server, cache, monkeypatch).annotate(pairs)  # then it is final: nothing is bought again
        assert len(server.requests) == 10 and all(a.cached for a in third)
        assert [a.outcome for a in third] == ["labelled"] * 2 + ["unparsed"] + ["labelled"] * 2
        never = judge(server, cache, monkeypatch, reask_unparsed=0).annotate(pairs)
        assert len(server.requests) == 10 and never[2].outcome == "unparsed"


def test_a_transiently_unreadable_batch_ends_fully_labelled_and_nothing_unparsed_is_cached(tmp_path: Path,
                                                                                         monkeypatch):
    pairs, labels = tagged_pairs(5)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeOpenAIServer(PoisonResponder(poison=2, poison_left=2)) as server:
        annotator = judge(server, cache, monkeypatch)
        assert [a.preference for a in annotator.annotate(pairs)] == labels
        assert len(server.requests) == 2 + 5
    keys = [pair_key(annotator.fingerprint, p) for p in pairs]
    found = cache.get_many(keys)
    assert [found[k].preference for k in keys] == labels and {found[k].outcome for k in keys} == {"labelled"}


def test_a_poisoned_row_left_by_an_old_cache_is_not_served(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(3)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeOpenAIServer(TagResponder()) as server:
        fingerprint = judge(server, cache, monkeypatch).fingerprint
        with sqlite3.connect(cache.path) as db:  # what an unreadable batch left before outcomes existed
            db.executemany("INSERT INTO annotations (key, annotator, preference, raw_completion, tokens_in, "
                           "tokens_out, price_usd, latency_s, request_id, created) VALUES (?,?,?,?,?,?,?,?,?,?)",
                           [(pair_key(fingerprint, p), "test_judge", None, "garbage", 1, 1, 0.1, 0.1, "old", 0.0)
                            for p in pairs])
        annotations = judge(server, cache, monkeypatch).annotate(pairs)
        assert [a.preference for a in annotations] == labels and len(server.requests) == 1


def test_the_fake_server_can_answer_with_the_wrong_number_of_answers(tmp_path: Path, monkeypatch):
    pairs, labels = tagged_pairs(4)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FakeOpenAIServer(TagResponder()) as server:
        server.script(Fault("wrong_count"), Fault("wrong_count"))
        annotations = judge(server, cache, monkeypatch, batch_size=4).annotate(pairs)
        assert [a.preference for a in annotations] == labels
        assert server.answered() == 2 + 4  # both billed; then pair by pair
        assert [r.status for r in server.requests] == [200] * 6


# ------------------------------------------------------------------------------------ exactly once across processes
def annotate_process(source: Path, out: Path, url: str, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "alpacafarm", "annotate", str(source), "--annotator",
                             "gpt4_b1_noex", "--base-url", url, "-o", str(out), *extra], cwd=REPO_ROOT,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_three_concurrent_processes_pay_once_per_distinct_pair(tmp_path: Path, env):
    distinct, labels = tagged_pairs(6)
    records = [*distinct, distinct[0], distinct[3], distinct[5]]  # 9 records, 6 distinct pairs
    source = write_pairs(tmp_path / "p.jsonl", records)
    with FakeOpenAIServer(TagResponder(), latency_s=0.5) as server:
        processes = [annotate_process(source, tmp_path / f"out{k}.json", server.base_url, env,
                                      "--set", "max_concurrency=1") for k in range(3)]
        for process in processes:
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr
        assert len(server.requests) == 6 and server.answered() == 6
    assert cache_of(env).ledger().requests == 6 and cache_of(env).claims() == []
    assert set(cache_of(env).paid_keys().values()) == {1}
    expected = [*labels, labels[0], labels[3], labels[5]]
    for k in range(3):
        assert [r["preference"] for r in json.loads((tmp_path / f"out{k}.json").read_text())] == expected


def test_the_claims_of_a_killed_process_are_taken_over_at_once(tmp_path: Path, env):
    pairs, labels = tagged_pairs(6)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    slow = ["--set", "max_concurrency=2", "--set", "timeout_s=120", "--set", "claim_stale_s=600"]
    with FakeOpenAIServer(TagResponder(), latency_s=60) as server:  # the first process hangs on its requests
        first = annotate_process(source, tmp_path / "first.json", server.base_url, env, *slow)
        deadline = time.monotonic() + 60
        while len(server.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = cache_of(env).claims()
        assert len(held) == 6 and {c["pid"] for c in held} == {first.pid}  # it claimed every pair it will pay for
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        server.latency_s = 0.0
        started = time.monotonic()
        second = annotate_process(source, tmp_path / "second.json", server.base_url, env, *slow)
        _, stderr = second.communicate(timeout=120)
        assert second.returncode == 0, stderr
        assert time.monotonic() - started < 60  # a dead pid's claims are taken over without waiting for staleness
        assert len(server.requests) == 2 + 6  # the killed process's two requests in flight, then each pair once
    assert [r["preference"] for r in json.loads((tmp_path / "second.json").read_text())] == labels
    assert cache_of(env).claims() == [] and cache_of(env).ledger().requests == 6


# ------------------------------------------------------------------------------------ a pipeline stage
class FlakyJudge:
    """A judge endpoint: 'down' answers 500 to everything, 'flaky' fails every second request (from the second one
    after the switch), 'up' answers."""

    def __init__(self) -> None:
        self.mode = "down"
        self.seen = 0
        self._lock = threading.Lock()

    def switch(self, mode: str) -> None:
        with self._lock:
            self.mode, self.seen = mode, 0

    def __call__(self, body: dict) -> str | Fault:
        with self._lock:
            self.seen += 1
            if self.mode == "down" or (self.mode == "flaky" and self.seen % 2 == 0):
                return Fault("500")
        return "Output (1)"


@pytest.mark.slow
def test_a_preference_stage_with_failed_labels_is_never_complete_and_a_rerun_asks_only_the_missing(
        tiny_model_dir: str, tmp_path: Path, env):
    judge_endpoint = FlakyJudge()
    with FakeOpenAIServer(judge_endpoint) as server:
        recipe = tmp_path / "prefs.yaml"
        recipe.write_text(
            "name: prefs\n"
            f"model: {{name: {tiny_model_dir}}}\n"
            "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 12}\n"
            "annotator:\n  name: gpt4_b1_noex\n"
            f"  config: {{base_url: '{server.base_url}', max_retries: 0, max_concurrency: 1}}\n"
            "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n"
            "  - name: prefs\n    method: preference_data\n"
            "    config: {k: 2, sampling: {max_new_tokens: 6, temperature: 1.0}}\n")
        out = tmp_path / "run"
        manifest = out / "stages" / "prefs" / "manifest.json"

        down = run_cli("run", str(recipe), "--output-dir", str(out), env=env)
        assert down.returncode == 1, down.stderr
        error = [line for line in down.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "stage 'prefs'" in error[0] and server.base_url in error[0]
        assert "Traceback" not in down.stderr and json.loads(manifest.read_text())["status"] != "complete"

        judge_endpoint.switch("flaky")
        asked = len(server.requests)
        flaky = run_cli("run", str(recipe), "--output-dir", str(out), env=env)  # no --force
        assert flaky.returncode == 1 and json.loads(manifest.read_text())["status"] != "complete"
        n_pairs = len(server.requests) - asked
        assert n_pairs >= 8
        labelled = cache_of(env).ledger().requests
        assert labelled == (n_pairs + 1) // 2

        judge_endpoint.switch("up")
        asked = len(server.requests)
        up = run_cli("run", str(recipe), "--output-dir", str(out), env=env)
        assert up.returncode == 0, up.stderr
        assert len(server.requests) - asked == n_pairs - labelled  # only what was missing
        recorded = json.loads(manifest.read_text())
        assert recorded["status"] == "complete"
        assert recorded["artifact"]["metadata"]["outcomes"]["failed"] == 0
        assert recorded["artifact"]["metadata"]["ledger"]["requests"] == n_pairs - labelled
    rows = [json.loads(line) for line in (out / "stages/prefs/preferences.jsonl").read_text().splitlines()]
    assert len(rows) == n_pairs and all(r["preference"] == 1 and r["outcome"] == "labelled" for r in rows)


def test_evaluate_with_a_dead_judge_exits_1_naming_the_endpoint(tmp_path: Path, env):
    from alpacafarm.data import BUILTIN_DIR, read_records

    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[:4]  # instructions with reference answers
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps([{"instruction": r["instruction"], "input": r.get("input", ""),
                                    "output": f"An answer {i}."} for i, r in enumerate(records)]))
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = run_cli("evaluate", "--outputs", str(outputs), "--annotator", "gpt4_b1_noex", "--base-url", url,
                     "-o", str(tmp_path / "eval"), *FAST, env=env)
    assert result.returncode == 1, (result.returncode, result.stderr)
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and url in error[0] and "4 of 4 pairs have no label" in error[0], result.stderr
    assert "Traceback" not in result.stderr and SECRET not in result.stdout + result.stderr
