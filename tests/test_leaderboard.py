"""``alpacafarm leaderboard``: results gathered from metrics files, run directories and AlpacaEval annotations
into one sorted table, written as CSV, JSON and a readable PNG bar plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import run_cli

from alpacafarm.data import write_json
from alpacafarm.errors import UserError
from alpacafarm_evaluation.leaderboard import build_leaderboard, write_leaderboard

RESULTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tatsu-lab_alpaca_eval" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _metrics(win_rate: float, se: float, generator: str | None = None) -> dict:
    return {"win_rate": win_rate, "standard_error": se, "n_wins": 1, "n_wins_base": 1, "n_draws": 0, "n_total": 2,
            "n_unparsed": 0, "avg_length": 10, "discrete_win_rate": win_rate, "length_controlled_win_rate": None,
            "generator": generator, "annotator": "offline", "reference": "text_davinci_003"}


@pytest.fixture
def inputs(tmp_path: Path) -> list[Path]:
    """A run directory (stages/evaluate/metrics.json), a bare metrics.json, and an annotations file."""
    run_dir = tmp_path / "runs" / "ppo-run"
    write_json(run_dir / "stages" / "evaluate" / "metrics.json", _metrics(47.0, 1.7))
    bare = tmp_path / "sft" / "metrics.json"
    write_json(bare, _metrics(37.5, 1.6, generator="sft10k"))
    annotations = tmp_path / "judged" / "annotations.json"
    write_json(annotations, [{"preference": 2, "output_1": "ab", "output_2": "abcd", "generator_2": "best-of-16"},
                             {"preference": 0, "output_1": "ab", "output_2": "ab", "generator_2": "best-of-16"}])
    return [run_dir, bare, annotations]


def test_rows_are_named_and_sorted(inputs: list[Path]):
    rows = build_leaderboard(inputs)
    assert [r["name"] for r in rows] == ["best-of-16", "ppo-run", "sft10k"]
    assert [r["win_rate"] for r in rows] == [75.0, 47.0, 37.5]


def test_files_written_and_png_readable(inputs: list[Path], tmp_path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = write_leaderboard(build_leaderboard(inputs), tmp_path / "out" / "board")
    with open(files["csv"], encoding="utf-8", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [r["name"] for r in table] == ["best-of-16", "ppo-run", "sft10k"]
    assert float(table[1]["standard_error"]) == 1.7
    assert [r["name"] for r in json.loads(Path(files["json"]).read_text())["rows"]] == [r["name"] for r in table]
    png = Path(files["png"])
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = plt.imread(png)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def test_cli_over_alpaca_eval_results(tmp_path: Path):
    if not RESULTS.is_dir():
        pytest.skip(f"shared AlpacaEval data not found at {RESULTS}")
    folders = sorted(str(p.parent) for p in RESULTS.glob("*/alpaca_eval_gpt4/annotations.json"))
    result = run_cli("leaderboard", *folders, "-o", str(tmp_path / "ae1"), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert len(rows) == len(folders) and rows[0]["name"] == "gpt4_0314" and rows[-1]["name"] == "text_davinci_001"
    assert rows[0]["win_rate"] == pytest.approx(94.78, abs=0.01)
    assert (tmp_path / "ae1.png").read_bytes()[:8] == PNG_SIGNATURE


def test_bad_inputs_are_user_errors(tmp_path: Path):
    with pytest.raises(UserError, match="not found"):
        build_leaderboard([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"metrics\.json"):
        build_leaderboard([tmp_path / "empty"])
    write_json(tmp_path / "other.json", {"something": 1})
    with pytest.raises(UserError, match="neither"):
        build_leaderboard([tmp_path / "other.json"])


def _multi_system_run(run_dir: Path, systems: dict[str, float]) -> Path:
    """The layout of a run whose evaluation compared several systems (the quickstart's): no
    ``stages/evaluate/metrics.json``, one ``stages/evaluate/systems/<name>/metrics.json`` per system."""
    evaluation = run_dir / "stages" / "evaluate"
    for name, win_rate in systems.items():
        folder = evaluation / "systems" / name.replace("/", "__")  # as the evaluator names them
        write_json(folder / "metrics.json", _metrics(win_rate, 2.0, generator=name))
    write_json(evaluation / "results.json", {"rows": [{"system": n, "win_rate": w} for n, w in systems.items()]})
    return run_dir


def test_a_multi_system_run_gives_one_row_per_system(tmp_path: Path, inputs: list[Path]):
    quick = _multi_system_run(tmp_path / "runs" / "quickstart", {"outputs": 20.0, "best_of_n/n=8": 35.0})
    rows = build_leaderboard([quick, inputs[1]])
    assert [(r["name"], r["win_rate"]) for r in rows] == [("sft10k", 37.5), ("best_of_n/n=8", 35.0),
                                                          ("outputs", 20.0)]
    assert rows[1]["source"].endswith("stages/evaluate/systems/best_of_n__n=8/metrics.json")
    # the evaluation stage folder itself is an input too
    assert len(build_leaderboard([quick / "stages" / "evaluate"])) == 2


def test_systems_of_several_runs_are_told_apart_by_run(tmp_path: Path):
    a = _multi_system_run(tmp_path / "runs" / "quickstart", {"outputs": 20.0, "best_of_n": 35.0})
    b = _multi_system_run(tmp_path / "runs" / "quickstart-x2", {"outputs": 25.0, "best_of_n": 30.0})
    names = [r["name"] for r in build_leaderboard([a, b])]
    assert names == ["best_of_n (quickstart)", "best_of_n (quickstart-x2)", "outputs (quickstart-x2)",
                     "outputs (quickstart)"]


def test_a_run_whose_evaluation_did_not_finish_is_an_error(tmp_path: Path):
    run = _multi_system_run(tmp_path / "runs" / "killed", {"outputs": 20.0})
    write_json(run / "stages" / "evaluate" / "manifest.json", {"stage": "evaluate", "status": "running"})
    with pytest.raises(UserError, match=r"killed: its evaluation is not complete .*status 'running'"):
        build_leaderboard([run])
    write_json(run / "stages" / "evaluate" / "manifest.json", {"stage": "evaluate", "status": "complete"})
    assert [r["name"] for r in build_leaderboard([run])] == ["outputs"]


@pytest.mark.parametrize("value", ["high", True, float("nan"), [1]], ids=["text", "bool", "nan", "list"])
def test_a_non_numeric_column_is_an_error_naming_the_file(tmp_path: Path, value):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({**_metrics(40.0, 1.0), "standard_error": value}))
    with pytest.raises(UserError, match=rf"^{path}: 'standard_error' must be a number, got "):
        build_leaderboard([path])


@pytest.mark.slow
def test_cli_over_real_quickstart_style_runs(tmp_path: Path, tiny_model_dir: str):
    """``alpacafarm leaderboard runs/*/`` (the README's command) over two real runs that each evaluated two
    policies: one row per system and run."""
    import shutil

    recipe = tmp_path / "multi.yaml"
    recipe.write_text(
        "name: multi\n"
        f"model: {{name: {tiny_model_dir}, dtype: float32, device: cpu}}\n"
        "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 8}\n"
        "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 3}}\n"
        "  - {name: greedy, method: generate_outputs, config: {sampling: {temperature: 0.0, max_new_tokens: 8}}}\n"
        "  - {name: sampled, method: generate_outputs, config: {sampling: {temperature: 1.0, max_new_tokens: 8}}}\n"
        "evaluation: {evaluator: win_rate, annotator: offline, policy: [greedy, sampled]}\n"
    )
    runs = tmp_path / "runs"
    result = run_cli("run", str(recipe), "--output-dir", str(runs / "first"))
    assert result.returncode == 0, result.stderr
    assert not (runs / "first" / "stages" / "evaluate" / "metrics.json").exists()
    shutil.copytree(runs / "first", runs / "second")
    result = run_cli("leaderboard", "runs/first/", "runs/second/", "-o", "board", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert sorted(r["name"] for r in rows) == ["greedy (first)", "greedy (second)", "sampled (first)",
                                                "sampled (second)"]
    assert all(isinstance(r["win_rate"], float) and r["n_total"] == 3 for r in rows)
    assert (tmp_path / "board.png").read_bytes()[:8] == PNG_SIGNATURE
