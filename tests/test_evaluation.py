"""Win-rate evaluation: exact reproduction of AlpacaEval's leaderboards, hand-computed metrics, the
``alpacafarm evaluate`` command end to end, and the ``win_rate`` evaluator inside a real pipeline."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from conftest import run_cli

import alpacafarm
from alpacafarm.data import BUILTIN_DIR, read_records
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext, System
from alpacafarm.testing import write_records
from alpacafarm_evaluation import metrics as wr

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
RESULTS, BOARDS = (DATA_DIR / "tatsu-lab_alpaca_eval" / "results",
                   DATA_DIR / "tatsu-lab_alpaca_eval" / "src" / "alpaca_eval" / "leaderboards")
AE1_CSV = BOARDS / "data_AlpacaEval" / "alpaca_eval_gpt4_leaderboard.csv"
AE2_CSV = BOARDS / "data_AlpacaEval_2" / "weighted_alpaca_eval_gpt4_turbo_leaderboard.csv"
needs_data = pytest.mark.skipif(not AE1_CSV.is_file(), reason=f"shared AlpacaEval data not found under {DATA_DIR}")


def _board(path: Path) -> dict[str, dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as fh:
        return {row[""]: row for row in csv.DictReader(fh)}


def _systems(annotator: str) -> list[str]:
    return (sorted(p.parents[1].name for p in RESULTS.glob(f"*/{annotator}/annotations.json")) if RESULTS.is_dir()
            else [])


def _assert_matches_board(metrics: dict, row: dict[str, str], *, avg_length: bool = True) -> None:
    assert metrics["win_rate"] == pytest.approx(float(row["win_rate"]), abs=0.01)
    assert metrics["standard_error"] == pytest.approx(float(row["standard_error"]), abs=0.01)
    for key in ("n_wins", "n_wins_base", "n_draws", "n_total"):
        assert metrics[key] == int(row[key]), key
    if row.get("discrete_win_rate"):
        assert metrics["discrete_win_rate"] == pytest.approx(float(row["discrete_win_rate"]), abs=0.01)
    if avg_length:
        assert metrics["avg_length"] == int(row["avg_length"])


# ------------------------------------------------------------------------------------ AlpacaEval leaderboards


@needs_data
@pytest.mark.parametrize("system", _systems("alpaca_eval_gpt4"))
def test_reproduces_alpaca_eval_1_leaderboard(system: str):
    records = json.loads((RESULTS / system / "alpaca_eval_gpt4" / "annotations.json").read_text())
    metrics = wr.metrics_from_annotations(records)
    _assert_matches_board(metrics, _board(AE1_CSV)[system])
    assert metrics["n_unparsed"] == len(records) - metrics["n_total"]
    assert sum(s["n_total"] for s in metrics["per_source"].values()) == metrics["n_total"]
    assert set(metrics["per_source"]) == {"selfinstruct", "oasst", "koala", "helpful_base", "vicuna"}


@needs_data
def test_every_annotated_system_is_checked():
    # the parametrized test above silently shrinks if files move: pin the systems the shared data holds
    assert len(_systems("alpaca_eval_gpt4")) >= 7 and set(_systems("alpaca_eval_gpt4")) <= set(_board(AE1_CSV))


@needs_data
@pytest.mark.parametrize("system", [s for s in _systems("weighted_alpaca_eval_gpt4_turbo")
                                    if AE2_CSV.is_file() and s in _board(AE2_CSV)])
def test_reproduces_alpaca_eval_2_continuous_preferences(system: str):
    records = json.loads((RESULTS / system / "weighted_alpaca_eval_gpt4_turbo" / "annotations.json").read_text())
    # avg_length is not compared: one AlpacaEval 2 row (text_davinci_001) was computed on other outputs
    _assert_matches_board(wr.metrics_from_annotations(records), _board(AE2_CSV)[system], avg_length=False)


@needs_data
def test_cli_reproduces_leaderboard_row():
    path = RESULTS / "alpaca-7b" / "alpaca_eval_gpt4" / "annotations.json"
    result = run_cli("evaluate", "--annotations", str(path), "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    _assert_matches_board(metrics, _board(AE1_CSV)["alpaca-7b"])
    assert {"per_source", "length_controlled_win_rate", "n_unparsed"} <= set(metrics)
    # a leading '--' (needed by older cores that handed plugin commands argparse.REMAINDER) is accepted too
    separated = run_cli("evaluate", "--", "--annotations", str(path), "--json")
    assert separated.returncode == 0 and json.loads(separated.stdout) == metrics, separated.stderr


# ------------------------------------------------------------------------------------ hand-computed metrics


def test_ties_count_half_and_unparsed_are_dropped_and_counted():
    metrics = wr.compute_metrics([2, 1, 0, None, float("nan"), 2], sources=["a", "a", "b", "b", "b", None])
    scores = [1, 0, 0.5, 1]
    mean = sum(scores) / 4
    se = math.sqrt(sum((s - mean) ** 2 for s in scores) / 3) / 2
    assert metrics["win_rate"] == pytest.approx(62.5) and metrics["standard_error"] == pytest.approx(100 * se)
    assert (metrics["n_wins"], metrics["n_wins_base"], metrics["n_draws"]) == (2, 1, 1)
    assert (metrics["n_total"], metrics["n_unparsed"]) == (4, 2)
    assert metrics["discrete_win_rate"] == pytest.approx(62.5)
    per = metrics["per_source"]
    assert set(per) == {"a", "b", "unknown"}
    assert per["a"]["win_rate"] == pytest.approx(50.0) and per["a"]["n_total"] == 2
    assert per["b"]["win_rate"] == pytest.approx(50.0) and per["b"]["n_draws"] == 1 and per["b"]["n_total"] == 1
    assert per["unknown"]["win_rate"] == pytest.approx(100.0)


def test_continuous_preferences_and_discrete_rate():
    metrics = wr.compute_metrics([1.9, 1.2, 1.5, 2.0])
    assert metrics["win_rate"] == pytest.approx(100 * (0.9 + 0.2 + 0.5 + 1.0) / 4)
    assert (metrics["n_wins"], metrics["n_wins_base"], metrics["n_draws"]) == (2, 1, 1)
    assert metrics["discrete_win_rate"] == pytest.approx(62.5)


def test_avg_length_truncates_over_all_records():
    assert wr.compute_metrics([2, None], output_lengths=[10, 13])["avg_length"] == 11  # 11.5 → 11, unparsed counted


@pytest.mark.parametrize("bad", [3, -1, 0.5, "2", True])
def test_invalid_preferences_are_rejected(bad):
    with pytest.raises(ValueError, match="preference"):
        wr.compute_metrics([2, bad])


def test_lc_equals_raw_win_rate_when_lengths_are_equal():
    prefs = [2, 1, 1, 2, 0, 2, 1, 2]
    metrics = wr.compute_metrics(prefs, output_lengths=[100] * 8, reference_lengths=[100] * 8)
    assert metrics["length_controlled_win_rate"] == pytest.approx(metrics["win_rate"])


def test_lc_discounts_wins_bought_with_length():
    # 70 long outputs win 90% of the time, 30 short ones win 10%: raw 66%; at equal length the model says 50%.
    outcomes = [1.0] * 63 + [0.0] * 7 + [1.0] * 3 + [0.0] * 27
    diffs = [200.0] * 70 + [-200.0] * 30
    raw = 100 * sum(outcomes) / len(outcomes)
    lc = wr.length_controlled_win_rate(outcomes, diffs)
    assert raw == pytest.approx(66.0)
    assert lc == pytest.approx(50.0, abs=0.5) and lc < raw
    # and the mirror: a system that wins despite being shorter is credited for it
    mirrored = wr.length_controlled_win_rate(outcomes, [-d for d in diffs])
    assert mirrored == pytest.approx(50.0, abs=0.5)
    # wins unrelated to length: LC stays at the raw rate
    assert wr.length_controlled_win_rate([1.0, 0.0] * 50, [200.0, 200.0, -200.0, -200.0] * 25) == pytest.approx(50.0)


def test_bad_annotation_file_is_a_user_error(tmp_path: Path):
    from alpacafarm_evaluation.cli import evaluate_annotations

    path = tmp_path / "annotations.json"
    path.write_text(json.dumps([{"preference": 2}, {"preference": 7}]))
    with pytest.raises(UserError, match=r"record 1.*preference"):
        evaluate_annotations(str(path))
    with pytest.raises(UserError, match="not found"):
        evaluate_annotations(str(tmp_path / "missing.json"))


@pytest.mark.slow
def test_model_option_generates_then_evaluates(tiny_model_dir: str, tmp_path: Path):
    out = tmp_path / "eval"
    result = run_cli("evaluate", "--model", tiny_model_dir, "--annotator", "offline", "--max-instructions", "4",
                     "--max-new-tokens", "6", "--prompt-format", "alpaca", "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert metrics["n_total"] == 4 and metrics["win_rate"] <= 50  # a random tiny model loses to Davinci003
    assert (out / "annotations.json").is_file() and (out / "metrics.json").is_file()
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 4  # the generated answers are kept
    missing = run_cli("evaluate", "--model", tiny_model_dir)
    assert missing.returncode == 2 and "--model needs --annotator" in missing.stderr


# ------------------------------------------------------------------------------------ outputs → judge → metrics


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0]


def _truncated_outputs(n: int, merged: bool = False) -> list[dict]:
    """A weak "system": the first sentence of each bundled reference (the full reference should beat it)."""
    rows = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[:n]
    out = []
    for row in rows:
        record = {"instruction": row["instruction"], "input": row["input"], "output": _first_sentence(row["reference"]),
                  "generator": "first-sentence"}
        if merged and row["input"]:  # AlpacaEval's single-string form must match too
            record = {**record, "instruction": f"{row['instruction']}\n\n{row['input']}", "input": ""}
        out.append(record)
    return out


@pytest.mark.slow
def test_evaluate_outputs_end_to_end(tmp_path: Path):
    outputs = _truncated_outputs(20, merged=True)
    outputs += [{"instruction": "An instruction nobody wrote a reference for", "output": "x"},
                {"instruction": outputs[0]["instruction"] + " (edited)", "output": "y"},
                {**outputs[1], "output": "a second sample of an instruction already paired"}]
    write_records(tmp_path / "outputs.json", outputs)
    out_dir = tmp_path / "eval"
    result = run_cli("evaluate", "--outputs", str(tmp_path / "outputs.json"), "--annotator", "offline",
                     "-o", str(out_dir), "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert metrics["n_unmatched"] == 2 and metrics["n_extra_samples"] == 1
    assert metrics["n_total"] + metrics["n_unparsed"] == 20
    assert metrics["win_rate"] < 30, metrics  # first sentences lose to whole answers
    assert metrics["generator"] == "first-sentence" and metrics["annotator"] == "offline"
    annotations = json.loads((out_dir / "annotations.json").read_text())
    assert len(annotations) == 20 and all(a["output_1"] != a["output_2"] or a["preference"] == 0 for a in annotations)
    assert json.loads((out_dir / "metrics.json").read_text())["win_rate"] == metrics["win_rate"]
    # the written annotations score the same through --annotations
    rescored = wr.metrics_from_annotations(annotations)
    assert rescored["win_rate"] == pytest.approx(metrics["win_rate"])


def test_evaluate_outputs_user_errors(tmp_path: Path):
    write_records(tmp_path / "bad.jsonl", [{"instruction": "x"}])
    bad = run_cli("evaluate", "--outputs", str(tmp_path / "bad.jsonl"), "--annotator", "offline")
    assert bad.returncode == 2 and "'output'" in bad.stderr
    unknown = run_cli("evaluate", "--outputs", str(tmp_path / "bad.jsonl"), "--annotator", "no_such_judge")
    assert unknown.returncode == 2 and "no_such_judge" in unknown.stderr


# ------------------------------------------------------------------------------------ inside a pipeline


class WriteTruncatedOutputs(Method):
    """A stand-in policy stage: writes the truncated outputs file the evaluator judges."""

    requires = ()
    provides = "policy"

    def run(self, context: StageContext) -> Artifact:
        path = context.stage_dir / "outputs.jsonl"
        write_records(path, _truncated_outputs(12))
        return Artifact("dataset", str(path))


class OutputsPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("write_truncated_outputs", WriteTruncatedOutputs)


def test_win_rate_evaluator_in_a_pipeline(tmp_path: Path, register_test_plugin):
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe

    register_test_plugin(OutputsPlugin(), "evaluation-test")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: eval-toy\nstages:\n  - name: policy\n    method: write_truncated_outputs\n"
                      "evaluation:\n  evaluator: win_rate\n  annotator: offline\n  config: {max_instructions: 10}\n")
    run_dir = tmp_path / "run"
    outcomes = {o.name: o for o in Pipeline(load_recipe(recipe), get_registry(), run_dir).run()}
    assert outcomes["evaluate"].status == "ran"
    metrics_path = run_dir / "stages" / "evaluate" / "metrics.json"
    metrics = json.loads(metrics_path.read_text())
    assert metrics["n_total"] + metrics["n_unparsed"] == 10 and metrics["win_rate"] < 30
    assert metrics["generator"] == "first-sentence" and metrics["n_unmatched"] == 0
    artifact = outcomes["evaluate"].artifact
    assert artifact.kind == "evaluation" and Path(artifact.path) == metrics_path
    assert artifact.table.rows[0][0] == "all"
    assert [(j.name, Path(j.annotations).name, j.win_rate) for j in artifact.judged] == [
        ("policy", "annotations.json", metrics["win_rate"])]
    assert len(json.loads((run_dir / "stages" / "evaluate" / "annotations.json").read_text())) == 10

    again = {o.name: o for o in Pipeline(load_recipe(recipe), get_registry(), run_dir).run()}
    assert {o.status for o in again.values()} == {"skipped"}
    assert again["evaluate"].artifact.metadata["win_rate"] == metrics["win_rate"]


def test_evaluator_config_is_strict(tmp_path: Path, register_test_plugin):
    from alpacafarm.errors import RecipeError
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe

    register_test_plugin(OutputsPlugin(), "evaluation-test")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: eval-toy\nstages:\n  - {name: policy, method: write_truncated_outputs}\n"
                      "evaluation: {evaluator: win_rate, annotator: offline, config: {max_instruction: 10}}\n")
    with pytest.raises(RecipeError, match="max_instruction"):
        Pipeline(load_recipe(recipe), get_registry(), tmp_path / "run")


def test_evaluator_reads_folder_artifacts(tmp_path: Path):
    folder = tmp_path / "policy"
    write_records(folder / "generations.jsonl", _truncated_outputs(2))

    def context(artifact: Artifact) -> StageContext:
        return StageContext(stage="evaluate", stage_dir=tmp_path / "evaluate", run_dir=tmp_path, seed=0,
                            inputs={"policy": artifact}, recipe=None, registry=None)

    assert len(context(Artifact("outputs", str(folder / "generations.jsonl"))).outputs("policy")) == 2
    with pytest.raises(UserError, match="add a generate_outputs stage"):
        context(Artifact("model", str(folder))).outputs("policy")
    listing = Artifact("outputs", str(folder), systems=[System("a", str(folder / "generations.jsonl"))])
    with pytest.raises(UserError, match=r"without outputs.jsonl; it lists 1 systems \(read each System.outputs\)"):
        context(listing).outputs("policy")
    with pytest.raises(UserError, match="add a generate_outputs stage"):
        context(Artifact("model", None)).outputs("policy")
    write_records(folder / "outputs.jsonl", _truncated_outputs(3))  # the conventional file, without metadata
    assert len(context(Artifact("model", str(folder))).outputs("policy")) == 3


def test_an_evaluation_whose_judge_fails_is_never_complete_and_a_rerun_asks_only_the_missing(
        tmp_path: Path, register_test_plugin, monkeypatch):
    from alpacafarm.annotation import AnnotationFailed
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault

    register_test_plugin(OutputsPlugin(), "evaluation-test")
    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    state = {"up": False}
    with FakeOpenAIServer(lambda body: "Output (2)" if state["up"] else Fault("500")) as server:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(
            "name: eval-toy\nstages:\n  - name: policy\n    method: write_truncated_outputs\n"
            "evaluation:\n  evaluator: win_rate\n  config: {max_instructions: 10}\n  annotator:\n"
            "    name: gpt4_b1_noex\n"
            f"    config: {{base_url: '{server.base_url}', max_retries: 0, api_key_env: null}}\n")
        run_dir = tmp_path / "run"
        expected = r"stage 'evaluate'.* of 10 pairs have no label.*127\.0\.0\.1"
        with pytest.raises(AnnotationFailed, match=expected) as caught:
            Pipeline(load_recipe(recipe), get_registry(), run_dir).run()
        failed = int(str(caught.value).split(" of 10 pairs")[0].rsplit(" ", 1)[1])  # ties of identical outputs aside
        manifest = run_dir / "stages" / "evaluate" / "manifest.json"
        assert json.loads(manifest.read_text())["status"] != "complete"
        state["up"] = True
        asked = len(server.requests)
        outcomes = {o.name: o for o in Pipeline(load_recipe(recipe), get_registry(), run_dir).run()}
        assert outcomes["evaluate"].status == "ran" and len(server.requests) - asked == failed >= 5
        assert json.loads(manifest.read_text())["status"] == "complete"
        metrics = outcomes["evaluate"].artifact.metadata
        assert metrics["n_total"] == 10 and metrics["n_failed"] == 0 and metrics["ledger"]["requests"] == failed


# ------------------------------------------------------------------------------------- significance in results


def test_results_mark_differences_to_the_first_system_beyond_two_paired_ses():
    from alpacafarm_evaluation.evaluator import Candidate
    from alpacafarm_evaluation.results import results_rows, results_table

    keys = [f"q{i}" for i in range(40)]
    sft = {k: 0.0 for k in keys}  # the first system loses everywhere
    better = {k: 1.0 if i % 4 else 0.0 for i, k in enumerate(keys)}  # wins 30 of 40: Δ = +75, paired SE 6.9
    noisy = {k: 1.0 if i % 3 == 1 else 0.0 for i, k in enumerate(keys[:6])}  # 2 wins of 6 common: Δ = +33, SE 21
    same = dict(sft)

    def metrics(scores: dict[str, float]) -> dict[str, float]:
        return {"win_rate": 100 * sum(scores.values()) / len(scores), "standard_error": 0.0, "avg_length": 10}

    evaluated = [(Candidate(name, name, []), metrics(s), s) for name, s in
                 [("outputs", sft), ("better", better), ("noisy", noisy), ("same", same)]]
    rows = results_rows(evaluated, [None] * 4)
    assert [r["vs_system"] for r in rows] == [None, "outputs", "outputs", "outputs"]
    assert rows[1]["delta_vs_system"] == pytest.approx(75.0)
    # paired SE = sd(d) / sqrt(n) with d = 100 * (better - sft): sd of 30 ones and 10 zeros, times 100
    sd = math.sqrt(sum((d - 0.75) ** 2 for d in better.values()) / 39) * 100
    assert rows[1]["paired_se_vs_system"] == pytest.approx(sd / math.sqrt(40))
    assert [r["significant"] for r in rows] == [None, True, False, False]  # 33 < 2 x 21; same: Δ = 0, SE = 0
    assert rows[2]["delta_vs_system"] == pytest.approx(100 / 3)
    table = results_table(rows, "win-rate vs reference")
    assert table["columns"][6] == "Δ vs outputs"
    cells = [row[6] for row in table["rows"]]
    assert cells == ["-", f"+75.0 ± {sd / math.sqrt(40):.1f} *", f"+33.3 ± {rows[2]['paired_se_vs_system']:.1f}",
                     "+0.0 ± 0.0"]
    assert "* beyond 2 SE" in table["title"]


def test_the_over_training_plot_reads_snapshots_against_the_system_they_start_from():
    """Figure 5's shape needs the starting point: the first system without a step is drawn as the start line."""
    from alpacafarm_evaluation.results import over_training_lines

    def row(system, stage, step, win_rate=30.0):
        return {"system": system, "stage": stage, "step": step, "win_rate": win_rate, "standard_error": 2.0}

    rows = [row("sft_outputs", "sft_outputs", None), row("ppo_outputs@8", "ppo_outputs", 8),
            row("ppo_outputs@4", "ppo_outputs", 4), row("clean@4", "clean", 4),
            row("clean@8", "clean", 8, win_rate=None)]
    lines, start = over_training_lines(rows)
    assert start is rows[0]
    assert {stage: [r["step"] for r in points] for stage, points in lines.items()} == {"ppo_outputs": [4, 8],
                                                                                       "clean": [4]}
    # a table that starts with a snapshot has no starting system to read the lines against
    assert over_training_lines(rows[1:])[1] is None


def test_gold_against_kl_draws_each_curves_paired_difference_to_the_first_system(tmp_path):
    """The middle panel of gold_vs_kl.png: Δ gold against the table's first system with its paired SE, the first
    system at Δ 0 on its own curve; rows the evaluation gave no paired difference are left out of it."""
    import matplotlib.image

    from alpacafarm_evaluation.results import kl_deltas, plot_gold_vs_kl

    def row(system, stage, kl, delta=None, se=None, first="bon/best_of_1"):
        return {"system": system, "stage": stage, "kl": kl, "gold": 0.1, "gold_se": 0.1,
                "vs_system": None if system == first else first, "delta_gold_vs_system": delta,
                "paired_se_gold_vs_system": se, "train_reward": None, "proxy_reward": 0.5}

    rows = [row("bon/best_of_1", "bon", 0.0), row("bon/best_of_4", "bon", 0.64, 0.3, 0.07),
            row("ppo@8", "ppo", 1.7, 0.26, 0.07), row("ppo@16", "ppo", 2.6, 0.2, 0.08),
            row("noisy@8", "noisy", 1.0), row("noisy@16", "noisy", 2.0)]
    first, deltas = kl_deltas(rows)
    assert first == "bon/best_of_1"
    assert deltas == {"bon": [(0.0, 0.0, 0.0), (0.64, 0.3, 0.07)], "ppo": [(1.7, 0.26, 0.07), (2.6, 0.2, 0.08)]}

    three, two = tmp_path / "three.png", tmp_path / "two.png"
    plot_gold_vs_kl(rows, three)
    plot_gold_vs_kl([{**r, "vs_system": None, "delta_gold_vs_system": None} for r in rows], two)
    assert matplotlib.image.imread(three).shape[1] == 1500   # three panels at dpi 100
    assert matplotlib.image.imread(two).shape[1] == 1000     # no paired differences: gold and proxy only
