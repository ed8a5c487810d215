"""Raising the budget resumes a stage where it stopped, and ``metrics.json`` counts every attempt (issue 41,
cases 4 and 5). Real online_dpo and GRPO stages on tiny models against a real local OpenAI-compatible server.

Prices are chosen so the budget admits an exact number of requests: input tokens are free, each answer
("Output (1)", 3 tokens for the server) costs $3, and a request reserves its upper bound (30 answer tokens, $30)
while in flight; with one request at a time, a budget of $(3 (n - 1) + 30 + 1) admits exactly n requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.testing.openai_server import FakeOpenAIServer

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


def budget_for(requests: int) -> float:
    return 3 * (requests - 1) + 30 + 1


def judge(base_url: str, budget: float) -> str:
    return ("\n  name: gpt4_b1_noex\n"
            f"  config: {{base_url: '{base_url}', max_retries: 0, max_concurrency: 1, "
            f"price: {{input: 0, output: 1000000}}, max_cost_usd: {budget}}}")


def recipe(tmp_path: Path, model: str, stage: str, annotator: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"name: budget\nmodel: {{name: {model}}}\n"
                    "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 16}\n"
                    f"annotator: {annotator}\n"
                    "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n" + stage)
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": "sk-test-budget-resume", "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"),
            "OMP_NUM_THREADS": "1"}


def ledger(env: dict[str, str]) -> AnnotationCache:
    return AnnotationCache(Path(env["ALPACAFARM_CACHE_DIR"]) / "annotations.sqlite")


def stop_then_raise(tmp_path: Path, make: callable, env: dict[str, str], paid_first: int) -> tuple[str, str]:
    """Run with a budget of ``paid_first`` requests (stops, exit 2), then with a larger one: the plan says
    resume, and the run finishes. Returns the second run's plan and run.log text."""
    out = tmp_path / "run"
    stopped = run_cli("run", str(make(budget_for(paid_first))), "--output-dir", str(out), env=env)
    assert stopped.returncode == 2 and "max_cost_usd" in stopped.stderr, stopped.stderr
    assert ledger(env).ledger().requests == paid_first
    raised = make(budget_for(1000))
    plan = run_cli("run", str(raised), "--output-dir", str(out), "--plan", env=env)
    done = run_cli("run", str(raised), "--output-dir", str(out), env=env)
    assert done.returncode == 0, done.stderr
    return plan.stdout, (out / "run.log").read_text()


def test_raising_the_budget_resumes_online_dpo_at_its_round(tiny_model_dir: str, tmp_path: Path, env: dict):
    train = ("steps_per_round: 2, per_device_train_batch_size: 4, learning_rate: 1.0e-2, max_new_tokens: 8, "
             "generation_batch_size: 4, save_strategy: 'no', report_to: none, rounds: 3, prompts_per_round: 4")
    with FakeOpenAIServer(lambda body: "Output (1)") as server:
        def make(budget: float) -> Path:
            return recipe(tmp_path, tiny_model_dir, f"  - {{name: odpo, method: online_dpo, config: {{{train}}}}}\n",
                          judge(server.base_url, budget))

        plan, log = stop_then_raise(tmp_path, make, env, paid_first=4)  # round 1's 4 pairs, then the budget
    assert "odpo" in plan and "resume" in plan and "fingerprint changed" not in plan, plan
    assert "round 1 already complete, kept" in log
    metrics = json.loads((tmp_path / "run/stages/odpo/metrics.json").read_text())
    assert ledger(env).ledger().requests == 12 and set(ledger(env).paid_keys().values()) == {1}
    # every attempt counted: 4 requests in the first, 8 in the second, at $3 each
    assert (metrics["annotation_requests"], metrics["attempts"]) == (12, 2)
    assert metrics["annotation_cost_usd"] == pytest.approx(36.0)


def test_raising_the_budget_resumes_grpo_from_its_checkpoint_and_counts_every_attempt(
        tiny_model_dir: str, tmp_path: Path, env: dict):
    config = ("per_device_train_batch_size: 8, num_generations: 4, max_completion_length: 6, learning_rate: 1.0e-2,"
              " use_reward_model: false, use_annotator: true, bf16: false, report_to: none, logging_steps: 1,"
              " warmup_steps: 0, max_steps: 4, save_strategy: steps, save_steps: 1")
    with FakeOpenAIServer(lambda body: "Output (1)") as server:
        def make(budget: float) -> Path:
            return recipe(tmp_path, tiny_model_dir, f"  - {{name: grpo, method: grpo, config: {{{config}}}}}\n",
                          judge(server.base_url, budget))

        plan, _ = stop_then_raise(tmp_path, make, env, paid_first=16)  # steps 1 and 2 (8 pairs each)
    assert "grpo" in plan and "resume" in plan and "fingerprint changed" not in plan, plan
    annotator = json.loads((tmp_path / "run/stages/grpo/metrics.json").read_text())["annotator"]
    assert annotator["pairs_per_step"] == 8.0
    assert annotator["attempts"] == 2 and annotator["ledger"]["requests"] == ledger(env).ledger().requests
    assert annotator["cost_usd"] == pytest.approx(3.0 * ledger(env).ledger().requests)
    assert annotator["pairs"] >= 32  # every step's 8 pairs, plus any step asked again after the checkpoint
