"""Best-of-n and expert iteration on tiny models, and the multi-system evaluation that plots their curve."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.data import read_records
from alpacafarm.recipe import load_recipe
from alpacafarm.reward_selection import best_index, select
from alpacafarm_methods.sampling.best_of_n import BestOfNConfig, powers_of_two

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- selection


def test_best_index_is_the_argmax_of_the_prefix_and_the_earliest_on_ties():
    rewards = [0.1, 0.7, 0.3, 0.9, 0.9, -2.0]
    assert [best_index(rewards, n) for n in range(1, 7)] == [0, 1, 1, 3, 3, 3]
    assert best_index([0.5, 0.5], 2) == 0
    with pytest.raises(ValueError):
        best_index([], 1)


def test_select_picks_the_highest_scoring_sample_of_a_known_scorer():
    # Known scorer: the reward is the number of "!" in the output.
    samples = [[{"instruction": f"q{i}", "output": text, "sample_index": j, "reward": float(text.count("!"))}
                for j, text in enumerate(texts)]
               for i, texts in enumerate([["a", "b!!", "c!", "d!!!"], ["!!", "x", "!!!!", "y"]])]
    assert [c["output"] for c in select(samples, 1)] == ["a", "!!"]
    assert [c["output"] for c in select(samples, 2)] == ["b!!", "!!"]
    assert [c["output"] for c in select(samples, 4)] == ["d!!!", "!!!!"]
    assert all(c["n"] == 4 for c in select(samples, 4))


def test_n_values_default_to_powers_of_two_and_are_checked():
    assert powers_of_two(16) == [1, 2, 4, 8, 16]
    assert powers_of_two(6) == [1, 2, 4, 6]
    assert powers_of_two(1) == [1]
    assert BestOfNConfig(n=8).resolved_n_values() == [1, 2, 4, 8]
    assert BestOfNConfig(n=8, n_values=[8, 2, 2]).resolved_n_values() == [2, 8]
    with pytest.raises(ValueError, match="n_values"):
        BestOfNConfig(n=4, n_values=[8])


# ----------------------------------------------------------------------------------------------- end to end


def end_to_end_recipe(tmp_path: Path, model: str) -> Path:
    """Every stage of the quickstart at tiny sizes: the tiny random model stands in for SmolLM2."""
    text = f"""
name: tiny-loop
seed: 3
model: {{name: {model}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 14}}
annotator: offline_ann
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 4}}
  - name: preferences
    method: preference_data
    config: {{k: 2, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 10}}}}
  - name: reward_model
    method: reward_model
    config: {{max_steps: 2, per_device_train_batch_size: 4, learning_rate: 1.0e-3, eval_fraction: 0.2,
              logging_steps: 1, save_strategy: 'no'}}
  - name: outputs
    method: generate_outputs
    config: {{sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
  - name: best_of_n
    method: best_of_n
    config: {{n: 4, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 4}}}}
  - name: expert_iteration
    method: expert_iteration
    config: {{n: 3, rounds: 2, max_new_tokens: 8, generation_batch_size: 5, max_steps: 2,
              per_device_train_batch_size: 4, learning_rate: 1.0e-3, logging_steps: 1, save_strategy: 'no'}}
  - name: expert_iteration_outputs
    method: generate_outputs
    inputs: {{sft_model: expert_iteration}}
    config: {{sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
  - name: optional_outputs
    method: generate_outputs
    enabled: false
    config: {{sampling: {{max_new_tokens: 8}}}}
evaluation:
  annotator: offline
  policy: [outputs, best_of_n, expert_iteration_outputs, optional_outputs]
"""
    path = tmp_path / "loop.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, Any]:
    """The tiny end-to-end recipe run once (first pass) and once more (second pass) in the same folder."""
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry

    tmp_path = tmp_path_factory.mktemp("loop")
    recipe = end_to_end_recipe(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "run"
    first = Pipeline(load_recipe(recipe), get_registry(), run_dir).run()
    second = Pipeline(load_recipe(recipe), get_registry(), run_dir).run()
    return {"recipe": recipe, "run_dir": run_dir, "first": first, "second": second,
            "artifacts": {o.name: o.artifact for o in first}}


@pytest.mark.slow
def test_the_loop_runs_every_stage_and_rerunning_skips_them_all(loop_run: dict[str, Any]):
    names = ["split", "preferences", "reward_model", "outputs", "best_of_n", "expert_iteration",
             "expert_iteration_outputs", "evaluate"]
    assert [o.name for o in loop_run["first"]] == names  # the disabled stage is not planned
    assert all(o.status == "ran" for o in loop_run["first"])
    assert [(o.name, o.status) for o in loop_run["second"]] == [(n, "skipped") for n in names]
    stages = loop_run["run_dir"] / "stages"
    for name in names:
        manifest = json.loads((stages / name / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["stage"] == name
    assert not (stages / "optional_outputs").exists()
    # The evaluation is wired to the reward model (proxy reward column) as well as to the three policies.
    evaluate = json.loads((stages / "evaluate" / "manifest.json").read_text())
    assert evaluate["inputs"]["reward_model"]["from"] == "reward_model"
    assert {k for k in evaluate["inputs"] if k.startswith("policy:")} == {
        "policy:outputs", "policy:best_of_n", "policy:expert_iteration_outputs"}


def test_the_loop_writes_the_results_table_and_the_curve(loop_run: dict[str, Any]):
    evaluation = loop_run["run_dir"] / "stages" / "evaluate"
    rows = json.loads((evaluation / "results.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["outputs", "best_of_1", "best_of_2", "best_of_4", "expert_iteration_outputs"]
    assert [r["n"] for r in rows] == [None, 1, 2, 4, None]
    for row in rows:
        assert 0.0 <= row["win_rate"] <= 100.0 and row["standard_error"] >= 0.0
        assert row["n_total"] == 4 and isinstance(row["proxy_reward"], float) and row["avg_length"] > 0
    # Best-of-n's proxy reward never falls as n grows (prefixes of the same samples).
    curve = [r["proxy_reward"] for r in rows if r["n"] is not None]
    assert curve == sorted(curve)
    csv_lines = (evaluation / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("system,stage,n,win_rate") and len(csv_lines) == 6
    assert (evaluation / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (evaluation / "systems.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # one bar per system
    assert loop_run["artifacts"]["evaluate"].metadata["results"]["systems_png"] == str(evaluation / "systems.png")
    table = loop_run["artifacts"]["evaluate"].table
    assert [row[0] for row in table.rows] == [r["system"] for r in rows]
    judged = loop_run["artifacts"]["evaluate"].judged  # what the gate reads
    assert [(j.name, j.win_rate) for j in judged] == [(r["system"], r["win_rate"]) for r in rows]
    for row in rows:  # each system has its own judged annotations
        annotations = json.loads((evaluation / "systems" / row["system"] / "annotations.json").read_text())
        assert len(annotations) == 4 and {a["generator_2"] for a in annotations} == {row["system"]}


def test_best_of_n_keeps_the_argmax_of_the_reward_model_on_every_prefix(loop_run: dict[str, Any]):
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import RewardScorer

    stage = loop_run["run_dir"] / "stages" / "best_of_n"
    samples = read_records(stage / "samples.jsonl")
    assert len(samples) == 4 * 4
    # The stored rewards are the reward model's scores of exactly these outputs.
    reward_dir = loop_run["artifacts"]["reward_model"].path
    scorer = RewardScorer.from_path(reward_dir, ModelSpec(name=reward_dir))
    rescored = scorer.score_records(samples, [s["output"] for s in samples])
    assert rescored == pytest.approx([s["reward"] for s in samples], abs=1e-4)
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(s["instruction"], []).append(s)
    for n in (1, 2, 4):
        chosen = read_records(stage / f"best_of_{n}.jsonl")
        assert len(chosen) == 4
        for c in chosen:
            group = sorted(groups[c["instruction"]], key=lambda s: s["sample_index"])
            best = max(group[:n], key=lambda s: s["reward"])
            assert c["sample_index"] < n and c["reward"] == best["reward"] and c["output"] == best["output"]
    systems = {s.name: s for s in loop_run["artifacts"]["best_of_n"].systems}
    assert [(s.n, Path(s.outputs)) for s in systems.values()] == [(n, stage / f"best_of_{n}.jsonl") for n in (1, 2, 4)]
    assert systems["best_of_4"].proxy_reward >= systems["best_of_1"].proxy_reward
    assert [s.kl for s in systems.values()] == pytest.approx([0.0, math.log(2) - 0.5, math.log(4) - 0.75])


def test_prefix_evaluation_equals_a_separate_run(loop_run: dict[str, Any], tmp_path: Path):
    """Judging best_of_2.jsonl on its own gives exactly the sweep's best_of_2 row."""
    from alpacafarm.plugins import get_registry
    from alpacafarm_evaluation.pairing import annotate_and_score, load_references, pair_outputs

    outputs = read_records(loop_run["run_dir"] / "stages" / "best_of_n" / "best_of_2.jsonl")
    annotator = get_registry().create("annotator", "offline")
    try:
        pairs, skipped = pair_outputs(outputs, load_references(), None, "best_of_2", generator="best_of_2")
        separate = annotate_and_score(pairs, annotator, tmp_path / "separate", skipped)
    finally:
        annotator.close()
    row = next(r for r in json.loads((loop_run["run_dir"] / "stages/evaluate/results.json").read_text())["rows"]
               if r["system"] == "best_of_2")
    for key in ("win_rate", "standard_error", "n_wins", "n_wins_base", "n_draws", "n_total", "avg_length"):
        assert separate[key] == row[key]


def test_expert_iteration_trains_on_exactly_the_winners_of_each_round(loop_run: dict[str, Any]):
    stage = loop_run["run_dir"] / "stages" / "expert_iteration"
    artifact = loop_run["artifacts"]["expert_iteration"]
    assert artifact.path == str(stage / "round_2" / "model") and artifact.metadata["rounds"] == 2
    for r in (1, 2):
        round_dir = stage / f"round_{r}"
        samples = read_records(round_dir / "samples.jsonl")
        winners = read_records(round_dir / "winners.jsonl")
        assert len(samples) == 10 * 3 and len(winners) == 10
        by_instruction: dict[str, list[dict[str, Any]]] = {}
        for s in samples:
            by_instruction.setdefault(s["instruction"], []).append(s)
        for w in winners:
            best = max(sorted(by_instruction[w["instruction"]], key=lambda s: s["sample_index"]),
                       key=lambda s: s["reward"])
            assert (w["output"], w["reward"]) == (best["output"], best["reward"])
        metrics = json.loads((round_dir / "metrics.json").read_text())
        assert metrics["steps"] == 2 and metrics["mean_winner_reward"] >= metrics["mean_sample_reward"]
        assert [e for e in metrics["log_history"] if "loss" in e]
        assert (round_dir / "model" / "model.safetensors").is_file()
    # Round 2 sampled from round 1's model: its samples differ from round 1's.
    assert read_records(stage / "round_1/samples.jsonl") != read_records(stage / "round_2/samples.jsonl")


def test_paired_difference_against_the_smallest_n_is_hand_computable(loop_run: dict[str, Any]):
    from alpacafarm_evaluation.results import paired_difference

    # Four instructions; b improves one from a loss to a win and one from a draw to a win.
    base = {"a": 0.0, "b": 0.5, "c": 1.0, "d": 0.0}
    other = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "extra": 1.0}
    delta, se = paired_difference(other, base)
    diffs = [1.0, 0.5, 0.0, 0.0]
    mean = sum(diffs) / 4
    expected_se = (sum((d - mean) ** 2 for d in diffs) / 3 / 4) ** 0.5
    assert delta == pytest.approx(mean * 100) and se == pytest.approx(expected_se * 100)
    assert paired_difference({"x": 1.0}, base) == (None, None)

    rows = json.loads((loop_run["run_dir"] / "stages/evaluate/results.json").read_text())["rows"]
    sweep = [r for r in rows if r["n"] is not None]
    assert sweep[0]["delta_vs_smallest_n"] == 0.0 and sweep[0]["paired_standard_error"] == 0.0
    for row in sweep:  # the paired delta of a full overlap is the difference of the two win-rates
        assert row["delta_vs_smallest_n"] == pytest.approx(row["win_rate"] - sweep[0]["win_rate"])
    assert all(r["delta_vs_smallest_n"] is None for r in rows if r["n"] is None)
