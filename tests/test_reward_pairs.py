"""``reward_pairs``: the reward model's best against its worst of n samples, as preference pairs a DPO stage learns."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.data import read_records
from alpacafarm.errors import UserError
from alpacafarm_methods.sampling.reward_pairs import RewardPairsConfig, best_and_worst, ranked_pair, ranked_pairs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _group(*scored: tuple[str, float]) -> list[dict[str, Any]]:
    return [{"output": text, "reward": reward, "sample_index": i} for i, (text, reward) in enumerate(scored)]


def test_best_and_worst_are_the_extremes_of_the_rewards_the_earliest_on_a_tie():
    best, worst = best_and_worst(_group(("a", 0.2), ("b", 0.9), ("c", -1.0), ("d", 0.9), ("e", -1.0)))
    assert (best["output"], worst["output"]) == ("b", "c")
    assert best_and_worst(_group(("a", 0.5), ("b", 0.5), ("c", 0.5))) is None  # nothing ranks
    assert best_and_worst(_group(("same", 0.1), ("same", 0.4))) is None  # one text: no pair to learn from


def test_a_ranked_pair_prefers_the_best_in_either_position():
    record = {"instruction": "Name a colour.", "input": ""}
    best, worst = {"output": "Blue.", "reward": 1.5}, {"output": "I am.", "reward": -0.5}
    first = ranked_pair(record, best, worst, coin=0.2)
    second = ranked_pair(record, best, worst, coin=0.7)
    assert (first["output_1"], first["preference"], first["reward_1"], first["reward_2"]) == ("Blue.", 1, 1.5, -0.5)
    assert (second["output_1"], second["preference"], second["reward_1"], second["reward_2"]) == ("I am.", 2, -0.5, 1.5)
    assert first["annotator"] == second["annotator"] == "reward_model"


def test_no_ranked_pair_at_all_fails_instead_of_writing_an_empty_dataset():
    records = [{"instruction": "Name a colour.", "input": ""}, {"instruction": "Say hi.", "input": ""}]
    alike = [_group(("Blue.", 0.3), ("Red.", 0.3)), _group(("Hi.", -1.0), ("Hi.", 2.0))]
    with pytest.raises(UserError, match="stage 'pairs': the reward model ranks no two samples of any of the 2"):
        ranked_pairs(records, alike, 0, "stage 'pairs'")
    one = ranked_pairs(records, [alike[0], _group(("Hi.", -1.0), ("Hello there.", 2.0))], 0, "stage 'pairs'")
    assert [(p["instruction"], max(p["reward_1"], p["reward_2"])) for p in one] == [("Say hi.", 2.0)]


def test_the_config_samples_the_training_split_and_needs_two_samples():
    assert RewardPairsConfig().split == "train"
    with pytest.raises(ValueError, match="n"):
        RewardPairsConfig(n=1)


RECIPE = """
name: tiny-reward-pairs
seed: 5
model: {{name: {model}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 26}}
annotator: offline_ann
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 2}}
  - name: preferences
    method: preference_data
    config: {{k: 2, max_instructions: 8, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 8}}}}
  - name: reward_model
    method: reward_model
    config: {{max_steps: 2, per_device_train_batch_size: 4, learning_rate: 1.0e-3, eval_fraction: 0.2,
              logging_steps: 1, save_strategy: 'no'}}
  - name: reward_pairs
    method: reward_pairs
    config: {{n: 4, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 8}}}}
  - name: dpo
    method: dpo
    inputs: {{preferences: reward_pairs}}
    config: {{max_steps: 2, per_device_train_batch_size: 4, learning_rate: 1.0e-4, logging_steps: 1,
              save_strategy: 'no'}}
"""


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, Any]:
    from alpacafarm.testing import run_recipe

    root = tmp_path_factory.mktemp("reward-pairs")
    recipe = root / "pairs.yaml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir), encoding="utf-8")
    return {"run_dir": root / "run", "artifacts": run_recipe(recipe, root / "run")}


@pytest.mark.slow
def test_each_pair_is_the_reward_models_best_against_its_worst(pairs_run: dict[str, Any]):
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import RewardScorer

    stage = pairs_run["run_dir"] / "stages" / "reward_pairs"
    samples, pairs = read_records(stage / "samples.jsonl"), read_records(stage / "preferences.jsonl")
    assert len(samples) == 24 * 4  # every training instruction (26 - 2 held out), 4 samples each
    reward_dir = pairs_run["artifacts"]["reward_model"].path
    scorer = RewardScorer.from_path(reward_dir, ModelSpec(name=reward_dir))
    assert scorer.score_records(samples, [s["output"] for s in samples]) == pytest.approx(
        [s["reward"] for s in samples], abs=1e-4)  # the stored rewards are the reward model's
    groups: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        groups.setdefault(sample["instruction"], []).append(sample)
    expected = {instruction: best_and_worst(group) for instruction, group in groups.items()}
    assert len(pairs) == sum(v is not None for v in expected.values()) >= 20
    for pair in pairs:
        best, worst = expected[pair["instruction"]]
        chosen, rejected = (("output_1", "output_2") if pair["preference"] == 1 else ("output_2", "output_1"))
        assert (pair[chosen], pair[rejected]) == (best["output"], worst["output"])
        assert max(pair["reward_1"], pair["reward_2"]) == max(s["reward"] for s in groups[pair["instruction"]])
        assert min(pair["reward_1"], pair["reward_2"]) == min(s["reward"] for s in groups[pair["instruction"]])
    assert {p["preference"] for p in pairs} == {1, 2}  # the winner's position is a coin, not always first
    metadata = pairs_run["artifacts"]["reward_pairs"].metadata
    assert metadata["n_pairs"] == len(pairs) and metadata["n_instructions"] == 24
    assert metadata["mean_reward_margin"] > 0


@pytest.mark.slow
def test_dpo_learns_from_the_reward_pairs_it_is_given(pairs_run: dict[str, Any]):
    stage = pairs_run["run_dir"] / "stages" / "dpo"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["inputs"]["preferences"]["from"] == "reward_pairs"
    metrics = json.loads((stage / "metrics.json").read_text())
    pairs = read_records(pairs_run["run_dir"] / "stages" / "reward_pairs" / "preferences.jsonl")
    assert metrics["n_pairs"] == len(pairs) and metrics["n_dropped_no_preference"] == 0
    assert Path(pairs_run["artifacts"]["dpo"].path, "config.json").is_file()


def test_the_gold_ranked_pairs_tool_keeps_the_golds_best_against_its_worst(tmp_path: Path):
    """``benchmarks/gold_ranked_pairs.py`` (the diagnostic in docs/gold.md) with a rubric gold: per instruction,
    every distinct answer of its pairs is scored and the highest is preferred to the lowest."""
    import importlib.util

    from alpacafarm_annotators.gold_functions import helpfulness

    tool_path = Path(__file__).resolve().parents[1] / "benchmarks" / "gold_ranked_pairs.py"
    spec = importlib.util.spec_from_file_location("gold_ranked_pairs", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    answers = {"List three fruits.": ["Apples.", "1. Apples\n2. Pears\n3. Plums",
                                      "Fruits:\n1. Apples\n2. Pears\n3. Plums"],
               "Name a colour.": ["Blue.", "Blue."]}  # one distinct answer: no pair
    records = [{"instruction": q, "input": "", "output_1": a, "output_2": b, "preference": 1}
               for q, texts in answers.items() for a, b in itertools.pairwise(texts)]
    source, out = tmp_path / "prefs.jsonl", tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert tool.main([str(source), str(out), "--gold", "alpacafarm_annotators.gold_functions:helpfulness"]) == 0
    pairs = read_records(out)
    texts = answers["List three fruits."]
    scores = helpfulness([{"instruction": "List three fruits.", "input": ""}] * 3, texts)
    assert len(pairs) == 1 and pairs[0]["preference"] == 1
    assert (pairs[0]["output_1"], pairs[0]["output_2"]) == (texts[scores.index(max(scores))],
                                                          texts[scores.index(min(scores))])
