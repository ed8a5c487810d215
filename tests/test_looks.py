"""The looks ledger: every evaluation on a world's held-out instructions is counted, validation looks apart, a
repeat of systems already seen is no new look, and a stage whose settings changed after a held-out look is marked."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.errors import UserError


def word_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    """A gold the tiny random model's answers differ in: 0.1 per distinct word."""
    return [0.1 * len(set(answer.split())) for answer in answers]


def recipe_text(model_dir: str, temperature: float = 0.7, split: str = "eval", gold: str = "test_looks:word_gold",
                split_seed: int = 7) -> str:
    return f"""
name: looks
seed: {split_seed}
model: {{name: {model_dir}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 20}}
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 4, validation_size: 4}}
  - name: sft_outputs
    method: generate_outputs
    config: {{split: {split}, sampling: {{temperature: 0.7, max_new_tokens: 4, batch_size: 4}}}}
  - name: tuned_outputs
    method: generate_outputs
    config: {{split: {split}, sampling: {{temperature: {temperature}, max_new_tokens: 4, batch_size: 4, seed: 1}}}}
evaluation:
  annotator:
    name: gold
    config: {{gold: "{gold}", mode: continuous}}
  policy: [sft_outputs, tuned_outputs]
"""


def run(tmp_path: Path, name: str, text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a recipe in its own folder; returns (results.json, the evaluation's printed table)."""
    from alpacafarm.testing import run_recipe

    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(text, encoding="utf-8")
    artifacts = run_recipe(recipe, tmp_path / name)
    results = json.loads((tmp_path / name / "stages" / "evaluate" / "results.json").read_text(encoding="utf-8"))
    table = artifacts["evaluate"].table
    return results, {"title": table.title, "rows": {row[0]: row for row in table.rows}}


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder (and so a looks ledger) of this test alone."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(folder))
    return folder


def test_held_out_looks_are_counted_repeats_are_not_and_retries_are_marked(tmp_path: Path, tiny_model_dir: str,
                                                                           own_cache: Path):
    first, table = run(tmp_path, "first", recipe_text(tiny_model_dir))
    looks = first["looks"]
    assert (looks["split"], looks["look"], looks["held_out_looks"], looks["validation_looks"]) == \
        ("held_out", 1, 1, 0)
    assert "held out: look 1" in table["title"] and "held-out looks 1, validation looks 0" in table["title"]
    assert (own_cache / "looks.sqlite").is_file()
    assert not any(r["retried_after_looks"] for r in first["rows"])

    # The same recipe in another folder judges the same systems again: no new look.
    again, table = run(tmp_path, "again", recipe_text(tiny_model_dir))
    assert again["looks"]["look"] is None and again["looks"]["held_out_looks"] == 1
    assert "no new look" in table["title"]

    # A stage's settings changed after the held-out look: a second look, that stage's row marked, the other not.
    retried, table = run(tmp_path, "retried", recipe_text(tiny_model_dir, temperature=1.0))
    assert (retried["looks"]["look"], retried["looks"]["held_out_looks"]) == (2, 2)
    rows = {r["system"]: r for r in retried["rows"]}
    assert rows["tuned_outputs"]["retried_after_looks"] == 1 and rows["sft_outputs"]["retried_after_looks"] is None
    assert "tuned_outputs ‡" in table["rows"] and "sft_outputs" in table["rows"]
    assert "‡ settings changed after an earlier held-out look" in table["title"]
    assert retried["looks"]["retried"] == {"tuned_outputs": 1}


def test_validation_looks_are_counted_apart_and_never_marked(tmp_path: Path, tiny_model_dir: str, own_cache: Path):
    held_out, _ = run(tmp_path, "held_out", recipe_text(tiny_model_dir))
    tuning, table = run(tmp_path, "tuning", recipe_text(tiny_model_dir, temperature=1.0, split="validation"))
    looks = tuning["looks"]
    assert (looks["split"], looks["look"], looks["validation_looks"], looks["held_out_looks"]) == \
        ("validation", 1, 1, 1)
    assert looks["world"] == held_out["looks"]["world"]  # one world, two splits
    assert not looks["retried"] and "‡" not in json.dumps(table["rows"], ensure_ascii=False)
    assert "validation: look 1" in table["title"]


def test_another_gold_or_split_seed_is_another_world(tmp_path: Path, tiny_model_dir: str, own_cache: Path):
    base, _ = run(tmp_path, "base", recipe_text(tiny_model_dir))
    other_gold, _ = run(tmp_path, "gold", recipe_text(tiny_model_dir, gold="test_looks:length_gold"))
    other_split, _ = run(tmp_path, "seed", recipe_text(tiny_model_dir, split_seed=8))
    worlds = {base["looks"]["world"], other_gold["looks"]["world"], other_split["looks"]["world"]}
    assert len(worlds) == 3
    assert other_gold["looks"]["held_out_looks"] == 1 and other_split["looks"]["held_out_looks"] == 1


def length_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    return [0.01 * len(answer) for answer in answers]


def test_an_evaluation_without_a_split_says_its_looks_are_not_counted(tmp_path: Path, tiny_model_dir: str,
                                                                      own_cache: Path):
    text = recipe_text(tiny_model_dir).replace("split: eval", "split: train")
    results, table = run(tmp_path, "train", text)
    assert results["looks"]["split"] is None and "looks not counted" in table["title"]
    assert not (own_cache / "looks.sqlite").exists()


def _record(path: str, index: int) -> int | None:
    from alpacafarm_evaluation.looks import LooksLedger

    summary = LooksLedger(path).record("w", "held_out", Path("/run"), "evaluate", [(f"s{index}", f"s{index}", "x")])
    return summary.look


def test_concurrent_evaluations_each_get_their_own_look(tmp_path: Path):
    """Eight processes record eight new systems at once: eight looks, numbered 1..8, none lost to a lock."""
    path = str(tmp_path / "looks.sqlite")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        numbers = pool.starmap(_record, [(path, i) for i in range(8)])
    assert sorted(numbers) == list(range(1, 9))


def test_a_file_that_is_not_a_ledger_is_one_line_naming_it(tmp_path: Path):
    from alpacafarm_evaluation.looks import LooksLedger

    path = tmp_path / "looks.sqlite"
    path.write_text("not a database at all, just some text that is long enough " * 20, encoding="utf-8")
    with pytest.raises(UserError, match=r"looks ledger .*looks\.sqlite") as caught:
        LooksLedger(path).record("w", "held_out", tmp_path, "evaluate", [("a", "a", "x")])
    assert "\n" not in str(caught.value)


def test_stage_settings_follow_the_inputs_but_not_the_code(tmp_path: Path):
    from alpacafarm_evaluation.looks import stage_settings

    def manifest(stage: str, config: str, code: str, inputs: dict[str, Any]) -> None:
        folder = tmp_path / "stages" / stage
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "manifest.json").write_text(json.dumps(
            {"fingerprint_parts": {"config": config, "code": code}, "inputs": inputs}), encoding="utf-8")

    manifest("train", "c1", "v1", {"data": {"from": "data", "id": "d1"}})
    manifest("outputs", "o1", "v1", {"sft_model": {"from": "train", "id": "run-1"}})
    before = stage_settings(tmp_path, "outputs")
    manifest("train", "c1", "v2", {"data": {"from": "data", "id": "d1"}})  # new code: the same settings
    assert stage_settings(tmp_path, "outputs") == before
    manifest("train", "c2", "v2", {"data": {"from": "data", "id": "d1"}})  # an upstream setting changed
    assert stage_settings(tmp_path, "outputs") != before
