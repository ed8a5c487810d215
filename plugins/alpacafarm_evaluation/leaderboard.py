"""Gather evaluation results into one leaderboard: rows sorted by win-rate, written as CSV, JSON and a bar plot.

An input is a ``metrics.json`` (written by ``alpacafarm evaluate`` or the ``evaluate`` stage), an AlpacaEval
``annotations.json`` (scored on the fly), or a folder holding either: a run directory
(``stages/evaluate/metrics.json``, or one row per system of a run that evaluated several,
``stages/evaluate/systems/*/metrics.json``), an evaluation folder, or AlpacaEval's ``results/<system>/<annotator>/``.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.paths import make_dir, read_text, user_path

COLUMNS = ("name", "win_rate", "standard_error", "length_controlled_win_rate", "n_wins", "n_wins_base", "n_draws",
           "n_total", "n_unparsed", "avg_length", "discrete_win_rate", "annotator", "reference", "source")
#: The columns that hold numbers (or null): anything else in a results file is an error naming the file.
NUMERIC = ("win_rate", "standard_error", "length_controlled_win_rate", "n_wins", "n_wins_base", "n_draws", "n_total",
           "n_unparsed", "avg_length", "discrete_win_rate")
#: Where a results file sits inside a folder given as input, in order of preference.
CANDIDATES = ("stages/evaluate/metrics.json", "metrics.json", "annotations.json")
#: Where the per-system results of an evaluation of several systems sit (one row each), in order of preference.
SYSTEM_CANDIDATES = ("stages/evaluate/systems/*/metrics.json", "systems/*/metrics.json")


def _resolve(path: Path) -> list[Path]:
    """The results files of an input: a file, or a folder holding one of :data:`CANDIDATES` or, for an evaluation
    of several systems, one per system (:data:`SYSTEM_CANDIDATES`)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        _check_complete(path)
        for candidate in CANDIDATES:
            if (path / candidate).is_file():
                return [path / candidate]
        for pattern in SYSTEM_CANDIDATES:
            found = sorted(p for p in path.glob(pattern) if p.is_file())
            if found:
                return found
        raise UserError(f"{path}: no {', '.join(CANDIDATES + SYSTEM_CANDIDATES)} inside (has its evaluation run?)")
    raise UserError(f"leaderboard input not found: {path}")


def _check_complete(folder: Path) -> None:
    """A run whose evaluation stage did not finish (failed, killed, still running) has no results to rank yet:
    some systems' files may exist while others are missing or stale."""
    manifest = next((m for m in (folder / "stages" / "evaluate" / "manifest.json", folder / "manifest.json")
                     if m.is_file()), None)
    if manifest is None:
        return
    try:
        status = json.loads(read_text(manifest, "manifest")).get("status")
    except (json.JSONDecodeError, AttributeError):
        return  # not a stage manifest: nothing to say
    if isinstance(status, str) and status != "complete":
        raise UserError(f"{folder}: its evaluation is not complete ({manifest}: status {status!r}); "
                        "finish the run first")


def _name(path: Path, metrics: dict[str, Any]) -> str:
    """The row's name: the evaluated system when recorded, else the folder that holds the results."""
    if metrics.get("generator") and metrics["generator"] != "system":
        return str(metrics["generator"])
    parts = path.resolve().parts
    if len(parts) >= 4 and parts[-3:-1] == ("stages", "evaluate"):  # a run directory: its name
        return parts[-4]
    return path.resolve().parent.name


def _check_numbers(path: Path, metrics: dict[str, Any]) -> None:
    """Every numeric column is a finite number or null; otherwise one line naming the file and the key."""
    for key in NUMERIC:
        value = metrics.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise UserError(f"{path}: {key!r} must be a number, got {shown}")


def _load(path: Path) -> dict[str, Any]:
    """One leaderboard row from one results file."""
    from alpacafarm_evaluation.metrics import metrics_from_annotations

    try:
        data = json.loads(read_text(path, "results file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if isinstance(data, list):
        try:
            metrics = metrics_from_annotations(data)
        except (ValueError, TypeError) as exc:
            raise UserError(f"{path}: {exc}") from None
        metrics.setdefault("annotator", next((r.get("annotator") for r in data if isinstance(r, dict)), None))
        metrics.setdefault("reference", next((r.get("generator_1") for r in data if isinstance(r, dict)), None))
    elif isinstance(data, dict) and "win_rate" in data:
        metrics = data
    else:
        raise UserError(f"{path}: neither metrics (an object with 'win_rate') nor annotations (a list)")
    _check_numbers(path, metrics)
    row = {key: metrics.get(key) for key in COLUMNS}
    row.update(name=_name(path, metrics), source=str(path))
    return row


def load_entries(input_path: str | Path) -> list[dict[str, Any]]:
    """The leaderboard rows of an input path: one, or one per system of a run that evaluated several."""
    return [_load(path) for path in _resolve(Path(input_path))]


def build_leaderboard(inputs: list[str] | list[Path]) -> list[dict[str, Any]]:
    """Rows for every input, best win-rate first; names made unique so no row hides another: a name that several
    inputs share gets its input's folder name (``sft (quickstart-x2)``), else a number (``name (2)``)."""
    loaded = [(Path(p).resolve().name, row) for p in inputs for row in load_entries(p)]
    names = [row["name"] for _, row in loaded]
    clashing = {n for n in names if names.count(n) > 1}
    for label, row in loaded:
        if row["name"] in clashing and label and label != row["name"]:
            row["name"] = f"{row['name']} ({label})"
    rows = [row for _, row in loaded]
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
    make_dir(prefix.parent, "output directory")
    files = {fmt: str(prefix.with_name(f"{prefix.name}.{fmt}")) for fmt in ("csv", "json", "png")}
    with user_path(files["csv"], "write"), open(files["csv"], "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    write_json(Path(files["json"]), {"columns": list(COLUMNS), "rows": rows})
    with user_path(files["png"], "write"):
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
