"""``alpacafarm annotate`` in real subprocesses against a real local server: outputs, secrecy, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from annotator_server import TagResponder, tagged_pairs
from conftest import REPO_ROOT, run_cli

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.testing.openai_server import FakeOpenAIServer

SECRET = "sk-live-SECRETKEY-do-not-store-9f8e7d6c5b4a"


def write_pairs(path: Path, n: int, start: int = 0) -> list[int]:
    pairs, labels = tagged_pairs(n, start=start)
    path.write_text("\n".join(json.dumps({"instruction": p.instruction, "output_1": p.output_1, "output_2": p.output_2,
                                          "id": i}) for i, p in enumerate(pairs)) + "\n")
    return labels


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": SECRET, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}


def test_annotate_writes_records_with_preferences_and_costs(tmp_path: Path, env):
    labels = write_pairs(tmp_path / "pairs.jsonl", 11)
    with FakeOpenAIServer(TagResponder()) as server:
        result = run_cli("annotate", str(tmp_path / "pairs.jsonl"), "--annotator", "gpt4_b5", "--base-url",
                         server.base_url, "--model-map", "gpt-4-0314=gpt-4o-mini", "-o", str(tmp_path / "out.json"),
                         env=env)
        assert result.returncode == 0, result.stderr
        assert {r.body["model"] for r in server.requests} == {"gpt-4o-mini"}
        assert server.seen_api_keys() == {SECRET}  # the key was sent ...
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [r["preference"] for r in rows] == labels and [r["id"] for r in rows] == list(range(11))
    assert all(r["annotator"] == "gpt4_b5" and r["price_usd"] > 0 and r["tokens_in"] > 0 for r in rows)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["n"] == 11 and summary["parsed"] == 11 and summary["cost_usd"] > 0
    # ... and never written anywhere: cache, outputs, console.
    for path in [tmp_path / "out.json", *Path(env["ALPACAFARM_CACHE_DIR"]).rglob("*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in result.stdout + result.stderr


def test_the_paper_pool_through_the_cli_is_reproducible_across_processes(tmp_path: Path, env):
    labels = write_pairs(tmp_path / "pairs.jsonl", 40)
    outputs = []
    with FakeOpenAIServer(TagResponder()) as server:
        for run in range(2):
            out = tmp_path / f"out{run}.json"
            run_env = {**env, "ALPACAFARM_CACHE_DIR": str(tmp_path / f"cache{run}"), "PYTHONHASHSEED": str(run)}
            result = run_cli("annotate", str(tmp_path / "pairs.jsonl"), "--annotator", "alpacafarm_ann_builtin",
                             "--base-url", server.base_url, "--seed", "11", "-o", str(out), env=run_env)
            assert result.returncode == 0, result.stderr
            outputs.append(json.loads(out.read_text()))
    keys = ["preference", "annotator", "swapped", "noise"]
    assert [[r[k] for k in keys] for r in outputs[0]] == [[r[k] for k in keys] for r in outputs[1]]
    first = outputs[0]
    assert all(r["preference"] == label for r, label in zip(first, labels, strict=True) if not r["noise"])
    assert len({r["annotator"] for r in first if not r["noise"]}) > 3 and any(r["swapped"] for r in first)


def test_sigkill_mid_run_then_rerun_repays_only_batches_in_flight(tmp_path: Path, env):
    write_pairs(tmp_path / "pairs.jsonl", 40)
    args = ["-m", "alpacafarm", "annotate", str(tmp_path / "pairs.jsonl"), "--annotator", "gpt4_b5", "-o",
            str(tmp_path / "out.json"), "--set", "max_concurrency=2", "--set", "batch_size=2"]
    with FakeOpenAIServer(TagResponder(), latency_s=0.4) as server:
        process = subprocess.Popen([sys.executable, *args, "--base-url", server.base_url], cwd=REPO_ROOT,
                                   env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while server.answered() < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        time.sleep(1.0)  # requests in flight at the kill are still answered (and billed) by the server
        first_run = server.answered()
        assert 5 <= first_run < 20, "the run must be killed mid-way"
        cached_batches = AnnotationCache(Path(env["ALPACAFARM_CACHE_DIR"]) / "annotations.sqlite").ledger().requests
        assert first_run - cached_batches <= 2  # at most the in-flight batches were paid without being kept
        result = subprocess.run([sys.executable, *args, "--base-url", server.base_url], cwd=REPO_ROOT,
                                env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert server.answered() - first_run == 20 - cached_batches  # the rest, and nothing already kept
    rows = json.loads((tmp_path / "out.json").read_text())
    assert all(r["preference"] in (1, 2) for r in rows) and sum(r["cached"] for r in rows) == 2 * cached_batches


def test_unknown_annotator_is_a_one_line_error(tmp_path: Path, env):
    write_pairs(tmp_path / "pairs.jsonl", 1)
    result = run_cli("annotate", str(tmp_path / "pairs.jsonl"), "--annotator", "gpt4_b55", "-o",
                     str(tmp_path / "o.json"), env=env)
    assert result.returncode == 2
    assert "unknown annotator 'gpt4_b55'; did you mean 'gpt4_b5'" in result.stderr and "Traceback" not in result.stderr


def test_replicates_write_k_annotations_per_pair_each_paid_once(tmp_path: Path, env):
    write_pairs(tmp_path / "pairs.jsonl", 12)
    base = ["annotate", str(tmp_path / "pairs.jsonl"), "--annotator", "alpacafarm_ann_builtin", "--seed", "3"]
    with FakeOpenAIServer(TagResponder()) as server:
        single = run_cli(*base, "--base-url", server.base_url, "-o", str(tmp_path / "one.json"), env=env)
        assert single.returncode == 0, single.stderr
        paid = server.answered()
        result = run_cli(*base, "--base-url", server.base_url, "--replicates", "3", "-o", str(tmp_path / "three.json"),
                         env=env)
        assert result.returncode == 0, result.stderr
        after_replicates = server.answered()
        again = run_cli(*base, "--base-url", server.base_url, "--replicates", "3", "-o", str(tmp_path / "again.json"),
                        env=env)
        assert again.returncode == 0, again.stderr
        assert server.answered() == after_replicates > paid  # replicates 1, 2 were bought once, then cached
    one, three = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "three"))
    assert len(three) == 36 and [(r["id"], r["replicate"]) for r in three] == [(i, k) for i in range(12)
                                                                              for k in range(3)]
    keys = ["preference", "annotator", "swapped", "noise"]
    zero = [r for r in three if r["replicate"] == 0]
    assert [[r[k] for k in keys] for r in zero] == [[r[k] for k in keys] for r in one]  # replicate 0: as before
    assert all(r["cached"] for r in zero if not r["noise"])
    by_pair = [[r["preference"] for r in three[3 * i:3 * i + 3]] for i in range(12)]
    assert any(len(set(labels)) > 1 for labels in by_pair)  # the pool's noise is drawn per replicate
    assert json.loads((tmp_path / "again.json").read_text()) == [{**r, "cached": r["cached"] or not r["noise"]}
                                                                 for r in three]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["n"], summary["pairs"], summary["replicates"]) == (36, 12, 3)
    variance = run_cli("compare", str(tmp_path / "three.json"), "--variance", "--json", env=env)
    assert variance.returncode == 0, variance.stderr
    measured = json.loads(variance.stdout)
    assert (measured["pairs"], measured["labels_per_pair"]) == (12, 3) and measured["variance"] > 0
