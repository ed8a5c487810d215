"""The preference-data stage: sample, pair, annotate with the recipe's annotator, write a datasets-loadable file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from alpacafarm_data.preferences import make_pairs


def test_pairing_drops_duplicates_and_empty_samples():
    assert make_pairs(["a", "b", "a", "c", " ", "d"], "adjacent") == [("a", "b"), ("c", "d")]
    assert make_pairs(["a", "a"], "adjacent") == []
    assert make_pairs(["a", "b", "c"], "all") == [("a", "b"), ("a", "c"), ("b", "c")]


@pytest.mark.slow
def test_preference_stage_in_a_recipe(tiny_model_dir: str, tmp_path: Path):
    recipe = tmp_path / "prefs.yaml"
    recipe.write_text(
        "name: prefs\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 12}\n"
        "annotator: offline_ann\n"
        "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n"
        "  - name: prefs\n    method: preference_data\n"
        "    config: {k: 4, sampling: {max_new_tokens: 6, temperature: 1.0}}\n"
    )
    out = tmp_path / "run"
    result = run_cli("run", str(recipe), "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "stages/prefs/preferences.jsonl").read_text().splitlines()]
    assert 10 <= len(rows) <= 20  # 10 train instructions x (4 samples -> up to 2 pairs)
    assert all(r["output_1"] != r["output_2"] and r["preference"] in (1, 2) for r in rows)
    assert {r["annotator"] for r in rows} <= {"offline", "noise"} and any(r["noise"] for r in rows)

    import datasets

    loaded = datasets.load_dataset("json", data_files=str(out / "stages/prefs/preferences.jsonl"), split="train")
    assert (loaded.num_rows == len(rows)
            and {"instruction", "output_1", "output_2", "preference"} <= set(loaded.features))
    again = run_cli("run", str(recipe), "--output-dir", str(out))
    assert again.returncode == 0 and again.stderr.count("unchanged, skipped") == 2
