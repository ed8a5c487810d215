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
