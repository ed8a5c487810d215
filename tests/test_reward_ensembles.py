"""Reward-model ensembles (Coste et al. 2024): k heads on one frozen backbone, combined by mean, worst case or
uncertainty weighting wherever a reward is used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alpacafarm.data import read_records
from alpacafarm.errors import RecipeError
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.rewards import RewardScorer, combine_members
from alpacafarm.testing import learnable_preferences, run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_worst_takes_the_lowest_member_and_uncertainty_weighting_subtracts_the_variance():
    members = [[1.0, 2.0, 3.0, 6.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 4.0, 0.0, 1.0]]
    assert combine_members(members, "mean") == pytest.approx([3.0, 0.5, 1.0])
    assert combine_members(members, "worst") == [1.0, 0.5, -1.0]
    # Population variance over the members: (4 + 1 + 0 + 9) / 4 = 3.5; (4 + 9 + 1 + 0) / 4 = 3.5.
    assert combine_members(members, "uncertainty_weighted", 0.5) == pytest.approx([3.0 - 1.75, 0.5, 1.0 - 1.75])
    assert combine_members(members, "uncertainty_weighted", 0.0) == pytest.approx([3.0, 0.5, 1.0])
    assert combine_members([[2.5]], "worst") == combine_members([[2.5]], "uncertainty_weighted", 9.0) == [2.5]
    with pytest.raises(ValueError, match="ensemble must be one of mean, worst, uncertainty_weighted, not 'median'"):
        combine_members(members, "median")
    with pytest.raises(ValueError, match="ensemble_coefficient"):
        combine_members(members, "uncertainty_weighted", -1.0)


def ensemble_recipe(tmp_path: Path, model: str, best_of_n: str = "") -> Path:
    records = learnable_preferences(60)
    prefs = write_records(tmp_path / "prefs.jsonl", records)
    splits = write_records(tmp_path / "eval.jsonl", [{"instruction": r["instruction"], "input": ""}
                                                      for r in records[:4]])
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""
name: ensemble
model: {{name: {model}, dtype: float32, device: cpu}}
data:
  preferences: {{path: {prefs}}}
  instruction_splits: {{path: {splits}}}
stages:
  - name: rm
    method: reward_model
    config: {{trainable_layers: 0, ensemble_size: 3, learning_rate: 1.0e-2, num_train_epochs: 2,
              weight_decay: 0.01, eval_fraction: 0.2}}
{best_of_n}""", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def ensemble_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("ensemble")
    stage = """  - name: best_of_n
    method: best_of_n
    inputs: {reward_model: rm}
    config: {n: 3, split: eval, ensemble: worst, sampling: {temperature: 1.0, max_new_tokens: 6, batch_size: 4}}
"""
    artifacts = run_recipe(ensemble_recipe(tmp_path, tiny_model_dir, stage), tmp_path / "run")
    return {"artifacts": artifacts, "run": tmp_path / "run", "spec": ModelSpec(name=tiny_model_dir)}


def test_an_ensemble_is_k_bootstrapped_heads_on_one_backbone(ensemble_run):
    import torch

    rm = ensemble_run["artifacts"]["rm"]
    assert rm.metadata["ensemble_size"] == 3 and rm.metadata["head_only"]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(rm.path).num_labels == 3
    scorer = RewardScorer.from_path(rm.path, ensemble_run["spec"])
    assert scorer.members == 3
    heads = scorer.model.score.weight
    assert heads.shape[0] == 3 and not torch.allclose(heads[0], heads[1]) and not torch.allclose(heads[1], heads[2])
    logged = json.loads((ensemble_run["run"] / "stages/rm/metrics.json").read_text())["log_history"]
    assert {e["member"] for e in logged} == {0, 1, 2}
    assert rm.metadata["eval_accuracy"] > 0.9  # the mean of members ranks the held-out pairs


def test_every_rule_combines_the_members_the_classifier_scores(ensemble_run):
    path, spec = ensemble_run["artifacts"]["rm"].path, ensemble_run["spec"]
    records = learnable_preferences(6)
    texts = [r["instruction"] + " " + r["output_1"] for r in records]
    members = RewardScorer.from_path(path, spec).member_scores(texts)
    assert len(members) == 6 and all(len(m) == 3 for m in members)
    assert len({round(m[0] - m[1], 6) for m in members}) > 1  # members disagree, by text
    for rule, coefficient in (("mean", 0.0), ("worst", 0.0), ("uncertainty_weighted", 2.0)):
        scorer = RewardScorer.from_path(path, spec, ensemble=rule, ensemble_coefficient=coefficient)
        assert scorer.score_texts(texts) == pytest.approx(combine_members(members, rule, coefficient), abs=1e-5)
    worst = RewardScorer.from_path(path, spec, ensemble="worst").score_texts(texts)
    assert worst == pytest.approx([min(m) for m in members], abs=1e-5)


def test_best_of_n_ranks_by_the_rule_it_names(ensemble_run):
    """best-of-n with ``ensemble: worst`` records each sample's lowest member score and keeps the sample whose
    lowest score is highest."""
    stage = ensemble_run["run"] / "stages/best_of_n"
    samples = read_records(stage / "samples.jsonl")
    scorer = RewardScorer.from_path(ensemble_run["artifacts"]["rm"].path, ensemble_run["spec"])
    members = scorer.member_scores([scorer.full_text(s, s["output"]) for s in samples])
    assert [s["reward"] for s in samples] == pytest.approx([min(m) for m in members], abs=1e-5)
    for chosen in read_records(stage / "best_of_3.jsonl"):
        group = [s["reward"] for s in samples if s["instruction"] == chosen["instruction"]]
        assert chosen["reward"] == max(group)


def test_a_ppo_critic_from_an_ensemble_starts_at_the_mean_member(ensemble_run):
    import torch

    from alpacafarm.model_loading import load_classifier
    from alpacafarm_methods.ppo.models import value_head

    classifier = load_classifier(ensemble_run["spec"], ensemble_run["artifacts"]["rm"].path)
    head = value_head(classifier, "reward_head")
    assert head.out_features == 1
    assert torch.allclose(head.weight[0], classifier.score.weight.float().mean(0))
    assert torch.count_nonzero(value_head(classifier, "zero").weight) == 0


def test_ensemble_settings_a_run_cannot_use_are_refused_naming_the_field(tiny_model_dir: str, tmp_path: Path):
    path = ensemble_recipe(tmp_path, tiny_model_dir, """  - name: best_of_n
    method: best_of_n
    config: {n: 2, ensemble: median}
""")
    with pytest.raises(RecipeError, match=r"stages\[1\].config.ensemble: Input should be .mean., .worst. or"):
        load_recipe(path).check()
    text = path.read_text().replace("trainable_layers: 0, ", "").replace("  - name: best_of_n", "#").replace(
        "    method: best_of_n\n", "").replace("    config: {n: 2, ensemble: median}\n", "")
    path.write_text(text)
    with pytest.raises(RecipeError, match=r"ensemble_size > 1 .*trainable_layers: 0"):
        load_recipe(path).check()
    for stage in ("ppo", "quark", "grpo", "expert_iteration"):
        bad = tmp_path / f"{stage}.yaml"
        bad.write_text(f"name: bad\nmodel: {{name: {tiny_model_dir}}}\nstages:\n  - name: s\n    method: {stage}\n"
                       "    config: {ensemble: worst, ensemble_coefficient: -1.0}\n")
        with pytest.raises(RecipeError, match="ensemble_coefficient"):
            load_recipe(bad).check()


def test_a_conservative_rule_on_a_single_reward_model_is_refused(tiny_model_dir: str):
    """worst / uncertainty_weighted on one member would silently be the plain score: a mistaken recipe."""
    from alpacafarm.errors import UserError

    spec = ModelSpec(name=tiny_model_dir)
    assert RewardScorer.from_path(tiny_model_dir, spec).members == 1  # the mean is fine
    for rule in ("worst", "uncertainty_weighted"):
        with pytest.raises(UserError, match=f"ensemble: {rule} needs an ensemble reward model"):
            RewardScorer.from_path(tiny_model_dir, spec, ensemble=rule)
