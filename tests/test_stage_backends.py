"""Sampling stages take any registered generation backend and its options from the recipe (here: an
OpenAI-compatible server on 127.0.0.1 standing in for ``vllm serve``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from alpacafarm.data import read_records
from alpacafarm.testing import run_recipe, write_records
from alpacafarm.testing.openai_server import FakeOpenAIServer, request_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INSTRUCTIONS = [{"instruction": f"Name a fruit that is {c}.", "input": ""} for c in ("red", "yellow", "green")]
PREFERENCES = [{"instruction": f"Say something about {t}.", "input": "", "output_1": f"{t} is great and useful.",
                "output_2": f"{t}?", "preference": 1} for t in ("tea", "rain", "maps", "bread", "snow", "wind")]


def answer(body: dict) -> str:
    """The server's answer names the instruction it was asked, so each sample can be traced to its request."""
    text = request_text(body)
    colour = next(c for c in ("red", "yellow", "green") if f"is {c}." in text)
    return f"A {colour} fruit, from the server."


def recipe(tmp_path: Path, model: str, base_url: str) -> Path:
    splits = write_records(tmp_path / "train.jsonl", INSTRUCTIONS)
    prefs = write_records(tmp_path / "prefs.jsonl", PREFERENCES)
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""
name: backends
model: {{name: {model}, dtype: float32, device: cpu}}
data:
  instruction_splits: {{path: {splits}}}
  preferences: {{path: {prefs}}}
stages:
  - name: reward_model
    method: reward_model
    config: {{trainable_layers: 0, eval_fraction: 0.0, max_steps: 5, report_to: none}}
  - name: expert_iteration
    method: expert_iteration
    config: {{n: 2, rounds: 1, split: train, backend: openai, backend_config: {{base_url: '{base_url}'}},
              max_new_tokens: 8, max_steps: 1, per_device_train_batch_size: 2, report_to: none,
              save_strategy: 'no'}}
  - name: best_of_n
    method: best_of_n
    inputs: {{sft_model: expert_iteration}}
    config: {{n: 2, split: train, backend: openai, backend_config: {{base_url: '{base_url}', model: served}},
              sampling: {{max_new_tokens: 8}}}}
""", encoding="utf-8")
    return path


def test_expert_iteration_and_best_of_n_sample_through_the_configured_backend(tmp_path: Path, tiny_model_dir: str):
    with FakeOpenAIServer(answer) as server:
        artifacts = run_recipe(recipe(tmp_path, tiny_model_dir, server.base_url), tmp_path / "run")
        models = [r.body["model"] for r in server.requests]
    winners = read_records(tmp_path / "run/stages/expert_iteration/round_1/winners.jsonl")
    assert [w["output"] for w in winners] == [answer({"prompt": f"is {c}."}) for c in ("red", "yellow", "green")]
    # Expert iteration sampled the SFT model (served under its path); best-of-n the name its config gives.
    assert models[:3] == [tiny_model_dir] * 3 and set(models[3:]) == {"served"} and len(models) == 6
    best = read_records(Path(artifacts["best_of_n"].path) / "best_of_2.jsonl")
    assert [b["output"] for b in best] == [w["output"] for w in winners]


@pytest.mark.slow
def test_evaluate_model_generates_through_the_chosen_backend(tmp_path: Path, tiny_model_dir: str):
    import json

    from conftest import run_cli

    from alpacafarm.testing.openai_server import FakeOpenAIServer

    with FakeOpenAIServer(lambda body: "An answer from the server.") as server:
        result = run_cli("evaluate", "--model", tiny_model_dir, "--annotator", "offline", "--max-instructions", "3",
                         "--prompt-format", "alpaca", "--backend", "openai", "--backend-config",
                         f"{{base_url: '{server.base_url}'}}", "-o", str(tmp_path / "eval"), "--json")
        models = {r.body["model"] for r in server.requests}
        n_requests = len(server.requests)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["n_total"] == 3 and n_requests == 3 and models == {tiny_model_dir}
    outputs = read_records(tmp_path / "eval" / "outputs.jsonl")
    assert [o["output"] for o in outputs] == ["An answer from the server."] * 3
    typo = run_cli("evaluate", "--model", tiny_model_dir, "--annotator", "offline", "--backend", "openai",
                   "--backend-config", "{base_ur: x}")
    assert typo.returncode == 2 and "unknown key 'base_ur'; did you mean 'base_url'" in typo.stderr
    assert len(typo.stderr.strip().splitlines()) == 1
