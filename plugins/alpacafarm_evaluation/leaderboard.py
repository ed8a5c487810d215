"""Gather evaluation results into one leaderboard: rows sorted by win-rate, written as CSV, JSON and a bar plot.

An input is a ``metrics.json`` (written by ``alpacafarm evaluate`` or the ``evaluate`` stage), an AlpacaEval
``annotations.json`` (scored on the fly), or a folder holding either: a run directory
(``stages/evaluate/metrics.json``), an evaluation folder, or AlpacaEval's ``results/<system>/<annotator>/``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError

COLUMNS = ("name", "win_rate", "standard_error", "length_controlled_win_rate", "n_wins", "n_wins_base", "n_draws",
           "n_total", "n_unparsed", "avg_length", "discrete_win_rate", "annotator", "reference", "source")
#: Where a results file sits inside a folder given as input, in order of preference.
CANDIDATES = ("stages/evaluate/metrics.json", "metrics.json", "annotations.json")


def _resolve(path: Path) -> Path:
    """The results file of an input (a file, or a folder holding one of :data:`CANDIDATES`)."""
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in CANDIDATES:
            if (path / candidate).is_file():
                return path / candidate
        raise UserError(f"{path}: no {', '.join(CANDIDATES)} inside")
    raise UserError(f"leaderboard input not found: {path}")


def _name(path: Path, metrics: dict[str, Any]) -> str:
    """The row's name: the evaluated system when recorded, else the folder that holds the results."""
    if metrics.get("generator") and metrics["generator"] != "system":
        return str(metrics["generator"])
    parts = path.resolve().parts
    if len(parts) >= 4 and parts[-3:-1] == ("stages", "evaluate"):  # a run directory: its name
        return parts[-4]
    return path.resolve().parent.name


def load_entry(input_path: str | Path) -> dict[str, Any]:
    """One leaderboard row from an input path."""
    from alpacafarm_evaluation.metrics import metrics_from_annotations

    path = _resolve(Path(input_path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if isinstance(data, list):
        try:
            metrics = metrics_from_annotations(data)
        except ValueError as exc:
            raise UserError(f"{path}: {exc}") from None
        metrics.setdefault("annotator", next((r.get("annotator") for r in data if isinstance(r, dict)), None))
        metrics.setdefault("reference", next((r.get("generator_1") for r in data if isinstance(r, dict)), None))
    elif isinstance(data, dict) and "win_rate" in data:
        metrics = data
    else:
        raise UserError(f"{path}: neither metrics (an object with 'win_rate') nor annotations (a list)")
    row = {key: metrics.get(key) for key in COLUMNS}
    row.update(name=_name(path, metrics), source=str(path))
    return row


def build_leaderboard(inputs: list[str] | list[Path]) -> list[dict[str, Any]]:
    """Rows for every input, best win-rate first; names made unique (``name (2)``) so no row hides another."""
    rows = [load_entry(p) for p in inputs]
    seen: dict[str, int] = {}
    for row in rows:
        seen[row["name"]] = seen.get(row["name"], 0) + 1
        if seen[row["name"]] > 1:
            row["name"] = f"{row['name']} ({seen[row['name']]})"
    return sorted(rows, key=lambda r: -(r["win_rate"] if r["win_rate"] is not None else float("-inf")))


def plot_leaderboard(rows: list[dict[str, Any]], path: Path) -> None:
    """A horizontal bar plot of win-rates with ± 1 standard error bars, best at the top, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: never open a window, works on headless machines
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["win_rate"] is not None][::-1]  # barh draws bottom-up
    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.4 * max(len(shown), 1)))
    try:
        ax.barh([r["name"] for r in shown], [r["win_rate"] for r in shown],
                xerr=[r["standard_error"] or 0.0 for r in shown], color="#4C72B0", capsize=3)
        ax.axvline(50, color="grey", linestyle="--", linewidth=1)  # parity with the reference
        ax.set_xlim(0, 100)
        ax.set_xlabel("win-rate vs reference (%) ± standard error")
        ax.set_title("leaderboard")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def write_leaderboard(rows: list[dict[str, Any]], prefix: str | Path) -> dict[str, str]:
    """Write ``PREFIX.csv``, ``PREFIX.json`` and ``PREFIX.png``; returns their paths by format."""
    from alpacafarm.data import write_json

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    files = {fmt: str(prefix.with_name(f"{prefix.name}.{fmt}")) for fmt in ("csv", "json", "png")}
    with open(files["csv"], "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    write_json(Path(files["json"]), {"columns": list(COLUMNS), "rows": rows})
    plot_leaderboard(rows, Path(files["png"]))
    return files


def show_leaderboard(rows: list[dict[str, Any]], files: dict[str, str]) -> None:
    """The leaderboard as a rich table (stderr), then where its files went."""
    from alpacafarm.console import console, print_table

    def fmt(value: Any) -> str:
        return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))

    print_table("leaderboard", ["#", "name", "win-rate %", "± SE", "LC win-rate %", "n", "avg length", "annotator"],
                [[i, r["name"], fmt(r["win_rate"]), fmt(r["standard_error"]), fmt(r["length_controlled_win_rate"]),
                  fmt(r["n_total"]), fmt(r["avg_length"]), fmt(r["annotator"])] for i, r in enumerate(rows, 1)])
    console().print("written: " + ", ".join(files.values()))
