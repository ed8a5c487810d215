"""``split_instructions``: held-out, validation and training instructions never overlap, and a tuning run
(``evaluate_on: validation``) sees the same training instructions as the final run but never a held-out one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alpacafarm.errors import RecipeError
from alpacafarm.pipeline import Pipeline
from alpacafarm.plugins import get_registry
from alpacafarm.recipe import load_recipe

RECIPE = """
name: split-test
seed: 7
model: {name: sshleifer/tiny-gpt2}
data:
  instructions: {builtin: alpaca_eval_sample, limit: 40}
stages:
  - name: split
    method: split_instructions
    config: {eval_size: 10, validation_size: 6}
"""


def _split(tmp_path: Path, name: str, *overrides: str) -> dict[str, list[str]]:
    recipe = tmp_path / "split.yaml"
    recipe.write_text(RECIPE)
    Pipeline(load_recipe(recipe, list(overrides)), get_registry(), tmp_path / name).run()
    stage = tmp_path / name / "stages" / "split"
    return {f.stem: [json.loads(line)["instruction"] for line in f.read_text().splitlines()]
            for f in stage.glob("*.jsonl")}


def test_validation_is_carved_from_training_and_a_tuning_run_never_sees_the_held_out_instructions(tmp_path: Path):
    final = _split(tmp_path, "final")
    tuning = _split(tmp_path, "tuning", "stages.split.config.evaluate_on=validation")
    assert (len(final["eval"]), len(final["validation"]), len(final["train"])) == (10, 6, 24)
    assert final["eval"] == final["test"] and tuning["eval"] == tuning["validation"] == final["validation"]
    assert tuning["train"] == final["train"] and tuning["test"] == final["test"]
    assert not set(final["test"]) & (set(final["validation"]) | set(final["train"]))
    assert not set(final["validation"]) & set(final["train"])
    # without a validation split the held-out instructions are the same ones: adding it only moves training ones
    plain = _split(tmp_path, "plain", "stages.split.config.validation_size=0")
    assert plain["eval"] == final["test"] and set(plain["train"]) == set(final["train"]) | set(final["validation"])


def test_evaluate_on_validation_without_a_validation_split_is_refused(tmp_path: Path):
    with pytest.raises(RecipeError, match="validation_size"):
        _split(tmp_path, "bad", "stages.split.config.validation_size=0", "stages.split.config.evaluate_on=validation")


def test_the_comparisons_tuning_recipe_starts_from_the_comparisons_data_and_judges_only_validation():
    """docs/comparison.md says the tuning variants start from the comparison's own preferences and reward model:
    that holds only while the shared stages, model, annotator and seed are the same, and the split differs only in
    what eval.jsonl holds."""
    root = Path(__file__).resolve().parents[1]
    compare = load_recipe(root / "recipes" / "compare.yaml").recipe
    tuning = load_recipe(root / "recipes" / "tuning" / "compare_validation.yaml").recipe
    stages = {s.name: s for s in compare.stages}
    tuned = {s.name: s for s in tuning.stages}
    assert tuned["split"].config == {**stages["split"].config, "evaluate_on": "validation"}
    for name in ("preferences", "reward_model", "sft_outputs", "sft_outputs_2"):
        assert (tuned[name].method, tuned[name].config) == (stages[name].method, stages[name].config), name
    assert (tuning.model, tuning.annotator, tuning.seed) == (compare.model, compare.annotator, compare.seed)
    assert tuning.evaluation == compare.evaluation.model_copy(update={"policy": tuning.evaluation.policy})
