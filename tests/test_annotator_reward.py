"""The recipe's annotator as the reward of GRPO and RLOO (issue 30): with the offline pool end to end, and against a
real local OpenAI-compatible server: the completion is judged against its reference (each pair paid once, cached
across runs), the scores are what TRL trains on, SFT-sampled references, the budget, and the one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.errors import UserError
from alpacafarm.testing import run_recipe
from alpacafarm.testing.openai_server import FakeOpenAIServer, request_text
from alpacafarm_methods.online_rl.annotator_reward import AnnotatorReward, preference_score

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ONLINE = ("per_device_train_batch_size: 8, num_generations: 4, max_completion_length: 6, learning_rate: 1.0e-2,"
          " use_reward_model: false, use_annotator: true, bf16: false, report_to: none, logging_steps: 1,"
          " save_strategy: 'no', warmup_steps: 0")


def recipe(tmp_path: Path, model: str, method: str, config: str, annotator: str = "offline_ann") -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"name: ar\nmodel: {{name: {model}}}\n"
                    "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 12}\n"
                    f"annotator: {annotator}\n"
                    "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n"
                    f"  - {{name: {method}, method: {method}, config: {{{ONLINE}, {config}}}}}\n")
    return path


def test_scores_are_the_probability_that_the_completion_wins():
    assert [preference_score(p) for p in (1, 2, 0, 1.75, None)] == [0.0, 1.0, 0.5, 0.75, None]
    with pytest.raises(ValueError, match="preference must be"):
        preference_score(3)


@pytest.mark.slow
def test_grpo_with_the_offline_pool_as_reward(tiny_model_dir: str, tmp_path: Path):
    from safetensors.torch import load_file

    artifact = run_recipe(recipe(tmp_path, tiny_model_dir, "grpo", "max_steps: 2"), tmp_path / "run")["grpo"]
    metadata = artifact.metadata
    assert metadata["reward_sources"] == ["annotator"]
    # 2 steps x 8 completions (2 prompts x 4), each judged against its prompt's recorded (Davinci003) answer
    annotator = metadata["annotator"]
    assert (annotator["reference"], annotator["pairs"], annotator["pairs_per_step"]) == ("recorded", 16, 8.0)
    assert annotator["unlabelled"] == 0 and annotator["cost_usd"] == 0
    history = json.loads((tmp_path / "run/stages/grpo/metrics.json").read_text())["log_history"]
    logged = [e for e in history if "rewards/annotator/mean" in e]
    # hard labels of the noisy pool: every reward is 0 or 1, so a mean over 8 is a multiple of 1/8
    assert len(logged) == 2 and all(abs(8 * e["rewards/annotator/mean"] % 1) < 1e-6 for e in logged)
    assert [e["annotator/pairs"] for e in logged] == [8.0, 8.0]
    before, after = load_file(f"{tiny_model_dir}/model.safetensors"), load_file(f"{artifact.path}/model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before)


# ------------------------------------------------------------------------------------------------ a real server
OUTPUT = re.compile(r"# Output \(1\)\n(.*?)\n\n# Output \(2\)\n(.*?)\n\nReply with", re.S)


def parity_judge(body: dict) -> str:
    """Prefers output 2 (the completion) when its text has an even number of characters."""
    _, second = OUTPUT.search(request_text(body)).groups()
    return "Output (2)" if len(second.strip()) % 2 == 0 else "Output (1)"


@pytest.fixture
def recorded_scores(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], list[str], list[float | None]]]:
    """Every call of the annotator reward: (completions, references, the scores TRL got)."""
    calls: list[tuple[list[str], list[str], list[float | None]]] = []
    real = AnnotatorReward.__call__

    def recording(self: AnnotatorReward, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[Any]:
        scores = real(self, prompts, completions, **kwargs)
        calls.append((list(completions), list(kwargs["reference"]), scores))
        return scores

    monkeypatch.setattr(AnnotatorReward, "__call__", recording)
    return calls


def api_annotator(url: str, extra: str = "") -> str:
    return f"\n  name: gpt4_b1_noex\n  config: {{base_url: '{url}', max_retries: 0{extra}}}"


def test_rloo_trains_on_what_the_server_judged_and_pays_each_pair_once(
        tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded_scores: list):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-annotator-reward")
    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    with FakeOpenAIServer(parity_judge) as server:
        path = recipe(tmp_path, tiny_model_dir, "rloo", "max_steps: 2, beta: 0.0", api_annotator(server.base_url))
        artifact = run_recipe(path, tmp_path / "run")["rloo"]
        asked = len(server.requests)
        history = json.loads((tmp_path / "run/stages/rloo/metrics.json").read_text())["log_history"]
        logged = [e["rewards/annotator/mean"] for e in history if "rewards/annotator/mean" in e]
        assert len(recorded_scores) == len(logged) == 2
        pairs = set()
        for (completions, references, scores), mean in zip(recorded_scores, logged, strict=True):
            assert scores == [float(len(c.strip()) % 2 == 0) for c in completions]  # the completion is output 2
            assert mean == pytest.approx(sum(scores) / len(scores))  # ... and TRL trained on exactly that
            pairs |= {(r.strip(), c.strip()) for r, c in zip(references, completions, strict=True)}
        # one request per distinct (reference, completion) pair; the ledger paid each once
        assert asked == server.answered() == len(pairs) == artifact.metadata["annotator"]["ledger"]["requests"]
        assert artifact.metadata["annotator"]["cost_usd"] > 0
        cache = AnnotationCache(tmp_path / "cache/annotations.sqlite")
        assert set(cache.paid_keys().values()) == {1}

        # the same run again (same seed, same completions): every pair comes from the cache, nothing is paid
        again = run_recipe(path, tmp_path / "again")["rloo"]
        assert len(server.requests) == asked and again.metadata["annotator"]["cached"] == 16
        assert again.metadata["annotator"]["ledger"]["requests"] == 0


def test_sft_references_are_sampled_once_and_judged_against(tiny_model_dir: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, recorded_scores: list):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-annotator-reward")
    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    with FakeOpenAIServer(parity_judge) as server:
        path = recipe(tmp_path, tiny_model_dir, "grpo", "max_steps: 1, annotator_reference: sft",
                      api_annotator(server.base_url))
        artifact = run_recipe(path, tmp_path / "run")["grpo"]
        texts = [request_text(r.body) for r in server.requests]
    references = [json.loads(line) for line in
                  (tmp_path / "run/stages/grpo/annotator_references.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (tmp_path / "run/stages/split/train.jsonl").read_text().splitlines()]
    assert [r["instruction"] for r in references] == [t["instruction"] for t in train]  # one per prompt
    assert all(r["output"] != t["reference"] for r, t in zip(references, train, strict=True))  # not Davinci003's
    (_, used, _), = recorded_scores
    sft = {r["output"] for r in references}
    assert set(used) <= sft and all(any(u.strip() in text for text in texts) for u in used)
    assert artifact.metadata["annotator"]["reference"] == "sft"


@pytest.mark.slow
def test_the_budget_stops_the_annotator_reward_with_one_line(tiny_model_dir: str, tmp_path: Path):
    from conftest import run_cli

    env = {"OPENAI_API_KEY": "sk-test-annotator-reward", "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    with FakeOpenAIServer(parity_judge) as server:
        path = recipe(tmp_path, tiny_model_dir, "grpo", "max_steps: 3",
                      api_annotator(server.base_url, ", max_cost_usd: 0.05, max_concurrency: 1"))
        done = run_cli("run", str(path), "--output-dir", str(tmp_path / "run"), env=env)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "max_cost_usd" in errors[0] and "Traceback" not in done.stderr, done.stderr
    spent = AnnotationCache(tmp_path / "cache/annotations.sqlite").ledger()
    assert 0 < spent.requests < 24 and spent.price_usd <= 0.05


def test_an_annotator_reward_without_an_annotator_or_a_reference_is_one_line(tiny_model_dir: str, tmp_path: Path):
    path = recipe(tmp_path, tiny_model_dir, "grpo", "max_steps: 1")
    path.write_text(path.read_text().replace("annotator: offline_ann\n", ""))
    with pytest.raises(UserError, match="needs an annotator: set 'annotator:'") as caught:
        run_recipe(path, tmp_path / "run")
    assert "\n" not in str(caught.value)
    path = recipe(tmp_path, tiny_model_dir, "grpo", "max_steps: 1, reference_field: davinci")
    with pytest.raises(UserError, match=r"of 10 prompt records have no 'davinci' answer") as caught:
        run_recipe(path, tmp_path / "run2")
    assert "\n" not in str(caught.value) and "annotator_reference: sft" in str(caught.value)
