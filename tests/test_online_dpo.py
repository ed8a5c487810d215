"""The ``online_dpo`` method (issue 30): rounds of sampling the current policy, annotating the pairs through the
annotation engine, and DPO steps. End to end on tiny models with the offline pool; against a real local
OpenAI-compatible server: every pair paid once across rounds, a server fault and a real kill (each resumed without
paying again), the budget stopping it with one line; and on two processes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, run_cli

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.testing import run_recipe
from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, request_text
from alpacafarm_methods.preference.online_dpo import pairs_per_round, round_prompts, sample_pairs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOG2 = math.log(2)
#: A tiny model at temperature 1 never repeats an 8-token sample, so every prompt gives exactly one pair.
TRAIN = ("steps_per_round: 3, per_device_train_batch_size: 4, learning_rate: 1.0e-2, max_new_tokens: 8,"
         " generation_batch_size: 4, save_strategy: 'no', report_to: none")


def recipe_text(model: str, stages: str, annotator: str = "offline_ann", n_instructions: int = 16) -> str:
    return (f"name: online\nmodel: {{name: {model}}}\n"
            f"data:\n  instructions: {{builtin: alpaca_eval_sample, limit: {n_instructions}}}\n"
            f"annotator: {annotator}\n"
            "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n" + stages)


def online_stage(name: str, config: str) -> str:
    return f"  - {{name: {name}, method: online_dpo, config: {{{TRAIN}, {config}}}}}\n"


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def history(stage_dir: Path, r: int) -> list[dict[str, Any]]:
    return [e for e in json.loads((stage_dir / f"round_{r}/metrics.json").read_text())["log_history"] if "loss" in e]


def weights(folder: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def differ(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return any(not torch.equal(a[k].float(), b[k].float()) for k in a)


# ------------------------------------------------------------------------------------------------ small pieces


def test_rounds_take_the_next_prompts_and_wrap_around():
    records = [{"instruction": str(i)} for i in range(5)]
    assert [r["instruction"] for r in round_prompts(records, 1, 2)] == ["0", "1"]
    assert [r["instruction"] for r in round_prompts(records, 3, 2)] == ["4", "0"]
    assert sample_pairs(["a", "b", "a", "c", " "], "adjacent") == [("a", "b")]  # duplicates and blanks dropped
    assert sample_pairs(["a", "b", "c"], "all") == [("a", "b"), ("a", "c"), ("b", "c")]


def test_the_budget_of_a_round_is_prompts_times_pairs_per_prompt():
    from alpacafarm_methods.preference.online_dpo import OnlineDPOMethodConfig

    def config(**kwargs: Any) -> OnlineDPOMethodConfig:
        return OnlineDPOMethodConfig(output_dir="x", report_to=[], **kwargs)

    assert pairs_per_round(config(prompts_per_round=10, k=2)) == 10
    assert pairs_per_round(config(prompts_per_round=10, k=4)) == 20
    assert pairs_per_round(config(prompts_per_round=10, k=4, pairing="all")) == 60


@pytest.mark.parametrize(("setting", "message"), [
    ("reference: sfft", "reference must be one of sft, previous"),
    ("k: 1", "k must be at least 2"),
    ("pairing: every", "pairing must be one of adjacent, all"),
])
def test_a_bad_setting_is_one_line_naming_it(setting: str, message: str, tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.errors import RecipeError
    from alpacafarm.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(recipe_text(tiny_model_dir, online_stage("odpo", setting)))
    with pytest.raises(RecipeError) as caught:
        load_recipe(recipe)
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
    assert message in str(caught.value) and "stages[1].config" in str(caught.value)


# ------------------------------------------------------------------------------------------------ the offline pool


@pytest.fixture(scope="module")
def offline_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Online (reference: SFT) and iterative (reference: previous round) DPO, 2 rounds of 5 prompts each."""
    tmp_path = tmp_path_factory.mktemp("online")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(recipe_text(tiny_model_dir, online_stage("online", "rounds: 2, prompts_per_round: 5")
                                  + online_stage("iterative", "rounds: 2, prompts_per_round: 5, reference: previous")))
    artifacts = run_recipe(recipe, tmp_path / "run")
    return {"recipe": recipe, "run": tmp_path / "run", "artifacts": artifacts}


@pytest.mark.slow
def test_each_round_labels_its_own_samples_and_trains_on_them(offline_run: dict[str, Any], tiny_model_dir: str):
    run = offline_run["run"]
    train = [r["instruction"] for r in rows(run / "stages/split/train.jsonl")]
    for stage in ("online", "iterative"):
        stage_dir = run / "stages" / stage
        artifact = offline_run["artifacts"][stage]
        assert artifact.path == str(stage_dir / "round_2/model")
        for r in (1, 2):
            pairs = rows(stage_dir / f"round_{r}/pairs.jsonl")
            # the round's 5 instructions, the next ones of the split, one pair of two distinct samples each
            assert [p["instruction"] for p in pairs] == train[5 * (r - 1):5 * r]
            assert all(p["output_1"] != p["output_2"] and p["preference"] in (1, 2) for p in pairs)
            assert {p["annotator"] for p in pairs} <= {"offline", "noise"}
            assert len(history(stage_dir, r)) == 3  # steps_per_round
        metrics = json.loads((stage_dir / "metrics.json").read_text())
        assert (metrics["n_pairs"], metrics["n_trained"], metrics["rounds"]) == (10, 10, 2)
        assert metrics["annotation_cost_usd"] == 0 and artifact.metadata["n_pairs"] == 10
        # the policy moved in each round
        assert differ(weights(tiny_model_dir), weights(stage_dir / "round_1/model"))
        assert differ(weights(stage_dir / "round_1/model"), weights(artifact.path))


def test_the_reference_is_the_sft_model_or_the_previous_round(offline_run: dict[str, Any]):
    """DPO's loss is log 2 with zero margins exactly when the policy equals its reference: at the first step of
    every round of iterative DPO, but only of the first round of online DPO (whose reference stays the SFT model)."""
    run = offline_run["run"]
    for stage in ("online", "iterative"):
        first = history(run / "stages" / stage, 1)[0]
        assert first["loss"] == pytest.approx(LOG2, abs=1e-4) and first["rewards/margins"] == pytest.approx(0, abs=1e-5)
    iterative = history(run / "stages/iterative", 2)[0]
    assert iterative["loss"] == pytest.approx(LOG2, abs=1e-4)
    assert iterative["rewards/margins"] == pytest.approx(0, abs=1e-5)
    online = history(run / "stages/online", 2)[0]
    assert abs(online["rewards/chosen"]) > 1e-3 or abs(online["rewards/rejected"]) > 1e-3


def test_round_two_samples_the_policy_of_round_one(offline_run: dict[str, Any]):
    from alpacafarm.generation import TransformersGenerator, generate_records
    from alpacafarm.recipe import ModelSpec
    from alpacafarm_methods.preference.online_dpo import OnlineDPOMethodConfig

    run = offline_run["run"]
    stage_dir = run / "stages/online"
    seed = json.loads((stage_dir / "manifest.json").read_text())["seed"]
    config = OnlineDPOMethodConfig(output_dir="x", report_to=[], k=2, max_new_tokens=8, generation_batch_size=4)
    prompts = rows(run / "stages/split/train.jsonl")[5:10]
    generator = TransformersGenerator.from_spec(ModelSpec(name=str(stage_dir / "round_1/model")))
    samples = generate_records(generator, prompts, config.sampling(seed + 2))
    expected = [(samples[i]["output"], samples[i + 1]["output"]) for i in range(0, 10, 2)]
    assert [(p["output_1"], p["output_2"]) for p in rows(stage_dir / "round_2/pairs.jsonl")] == expected


def test_a_round_killed_after_its_labels_retrains_on_them_without_asking(offline_run: dict[str, Any],
                                                                          monkeypatch: pytest.MonkeyPatch):
    """Round 2 interrupted during training: its recorded labels are trained on again; round 1 is kept as it was;
    no annotator is built at all."""
    import shutil

    from alpacafarm.method import StageContext

    stage_dir = offline_run["run"] / "stages/iterative"
    round_1 = (stage_dir / "round_1/model/model.safetensors").stat().st_mtime_ns
    before = weights(stage_dir / "round_2/model")
    shutil.rmtree(stage_dir / "round_2/model")
    (stage_dir / "round_2/round_complete.json").unlink()
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    (stage_dir / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))

    def no_annotator(self: StageContext, role: str = "feedback") -> Any:
        raise AssertionError("a recorded round asked the annotator again")

    monkeypatch.setattr(StageContext, "make_annotator", no_annotator)
    artifacts = run_recipe(offline_run["recipe"], offline_run["run"])
    assert (stage_dir / "round_1/model/model.safetensors").stat().st_mtime_ns == round_1
    assert artifacts["iterative"].metadata["n_pairs"] == 10
    after = weights(stage_dir / "round_2/model")
    assert not differ(before, after)  # the same labels, the same seed: the same round-2 policy


# ------------------------------------------------------------------------------------------------ a real server


class Judge:
    """Answers 'Output (1)' ('hang': the n-th request on never answers; 'fail': a 500 from the n-th on)."""

    def __init__(self, mode: str = "up", after: int = 0) -> None:
        self.mode, self.after, self.seen = mode, after, 0
        self._lock = threading.Lock()

    def __call__(self, body: dict) -> str | Fault:
        with self._lock:
            self.seen += 1
            if self.mode != "up" and self.seen > self.after:
                return Fault("hang", seconds=600) if self.mode == "hang" else Fault("500")
        return "Output (1)"


def server_recipe(tmp_path: Path, model: str, url: str, extra: str = "") -> Path:
    recipe = tmp_path / "r.yaml"
    annotator = ("\n  name: gpt4_b1_noex\n"
                 f"  config: {{base_url: '{url}', max_retries: 0, timeout_s: 900, max_concurrency: 2{extra}}}")
    recipe.write_text(recipe_text(model, online_stage("odpo", "rounds: 3, prompts_per_round: 4"), annotator))
    return recipe


def cache(env: dict[str, str]) -> AnnotationCache:
    return AnnotationCache(Path(env["ALPACAFARM_CACHE_DIR"]) / "annotations.sqlite")


def check_paid_once(server: FakeOpenAIServer, env: dict[str, str], stage_dir: Path) -> None:
    """Every labelled pair of every round was answered by exactly one request, and the ledger paid each once."""
    pairs = [p for r in (1, 2, 3) for p in rows(stage_dir / f"round_{r}/pairs.jsonl")]
    assert len(pairs) == 12 and all(p["preference"] == 1 for p in pairs)
    answered = [request_text(r.body) for r in server.requests if r.completed]
    for pair in pairs:
        assert sum(pair["output_1"].strip() in text and pair["output_2"].strip() in text for text in answered) == 1
    assert server.answered() == 12
    ledger = cache(env).ledger()
    assert ledger.requests == 12 and set(cache(env).paid_keys().values()) == {1} and cache(env).claims() == []


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": "sk-test-online-dpo", "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_a_server_fault_after_round_one_fails_loudly_and_the_rerun_pays_only_the_rest(
        tiny_model_dir: str, tmp_path: Path, env: dict[str, str]):
    judge = Judge("fail", after=4)  # round 1's 4 pairs are answered, then every request fails
    with FakeOpenAIServer(judge) as server:
        recipe = server_recipe(tmp_path, tiny_model_dir, server.base_url)
        out = tmp_path / "run"
        failed = run_cli("run", str(recipe), "--output-dir", str(out), env=env)
        assert failed.returncode == 1, failed.stderr
        errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "round 2" in errors[0] and server.base_url in errors[0], failed.stderr
        stage_dir = out / "stages/odpo"
        assert (stage_dir / "round_1/round_complete.json").is_file()
        assert not (stage_dir / "round_2/pairs.jsonl").exists()
        assert cache(env).ledger().requests == 4 and server.answered() == 4

        judge.mode = "up"
        done = run_cli("run", str(recipe), "--output-dir", str(out), env=env)  # no --force: it resumes
        assert done.returncode == 0, done.stderr
        check_paid_once(server, env, stage_dir)
    metrics = json.loads((stage_dir / "metrics.json").read_text())
    assert [r["annotation"]["requests"] for r in metrics["per_round"]] == [4, 4, 4]
    assert metrics["annotation_cost_usd"] > 0


@pytest.mark.slow
def test_a_killed_run_resumes_at_its_round_without_paying_again(tiny_model_dir: str, tmp_path: Path,
                                                                 env: dict[str, str]):
    judge = Judge("hang", after=4)  # round 2's requests hang: the process is killed while they are in flight
    with FakeOpenAIServer(judge) as server:
        recipe = server_recipe(tmp_path, tiny_model_dir, server.base_url)
        out = tmp_path / "run"
        process = subprocess.Popen([sys.executable, "-m", "alpacafarm", "run", str(recipe), "--output-dir", str(out)],
                                   cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while len(server.requests) < 6 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert len(server.requests) >= 6, process.stderr.read() if process.poll() is not None else "timed out"
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        stage_dir = out / "stages/odpo"
        assert (stage_dir / "round_1/round_complete.json").is_file() and server.answered() == 4
        assert json.loads((stage_dir / "manifest.json").read_text())["status"] == "running"

        judge.mode = "up"
        done = run_cli("run", str(recipe), "--output-dir", str(out), env=env)
        assert done.returncode == 0, done.stderr
        check_paid_once(server, env, stage_dir)  # the killed requests were never answered, so never paid
    assert "round 1 already complete, kept" in (out / "run.log").read_text()


@pytest.mark.slow
def test_the_budget_stops_online_dpo_with_one_line(tiny_model_dir: str, tmp_path: Path, env: dict[str, str]):
    """Half of what the whole run costs stops it in one line; with a larger budget the rerun pays only the rest."""
    with FakeOpenAIServer(Judge()) as server:
        first = server_recipe(tmp_path, tiny_model_dir, server.base_url)
        done = run_cli("run", str(first), "--output-dir", str(tmp_path / "one"), env=env)
        assert done.returncode == 0, done.stderr
        budget = cache(env).ledger().price_usd / 2
        env_b = {**env, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache-b")}
        (tmp_path / "b").mkdir()
        capped = server_recipe(tmp_path / "b", tiny_model_dir, server.base_url, f", max_cost_usd: {budget}")
        stopped = run_cli("run", str(capped), "--output-dir", str(tmp_path / "two"), env=env_b)
        assert stopped.returncode == 2, stopped.stderr
        errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "max_cost_usd" in errors[0] and "Traceback" not in stopped.stderr, stopped.stderr
        spent = cache(env_b).ledger()
        assert 1 <= spent.requests < 12 and spent.price_usd <= budget
        assert json.loads((tmp_path / "two/stages/odpo/manifest.json").read_text())["status"] != "complete"

        raised = server_recipe(tmp_path / "b", tiny_model_dir, server.base_url, f", max_cost_usd: {budget * 10}")
        again = run_cli("run", str(raised), "--output-dir", str(tmp_path / "two"), env=env_b)
        assert again.returncode == 0, again.stderr
    assert cache(env_b).ledger().requests == 12 and set(cache(env_b).paid_keys().values()) == {1}


# ------------------------------------------------------------------------------------------------ two processes


@pytest.mark.distributed
def test_online_dpo_on_two_processes(tiny_model_dir: str, tmp_path: Path, env: dict[str, str]):
    """Sampling split across ranks gives the one-process samples; the main process annotates; both ranks train."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(recipe_text(tiny_model_dir, online_stage("odpo", "rounds: 2, prompts_per_round: 4")))
    runs = {}
    for name, extra in (("one", []), ("two", ["--num-processes", "2", "--set",
                                              "stages.odpo.config.per_device_train_batch_size=2"])):
        done = run_cli("run", str(recipe), "--output-dir", str(tmp_path / name), *extra, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = tmp_path / name / "stages/odpo"
    assert "running on 2 processes" in (tmp_path / "two/run.log").read_text()
    assert rows(runs["one"] / "round_1/pairs.jsonl") == rows(runs["two"] / "round_1/pairs.jsonl")
    assert len(rows(runs["two"] / "round_2/pairs.jsonl")) == 4
    assert differ(weights(tiny_model_dir), weights(runs["two"] / "round_2/model"))
    metrics = json.loads((runs["two"] / "round_1/metrics.json").read_text())
    assert metrics["trainer_processes"] == 2
