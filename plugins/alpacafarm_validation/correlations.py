"""Rank correlation between two win-rate columns of a table of systems (the paper's Figure 3 / Table 2 check).

Given one row per system with a simulated and a human win-rate, :func:`correlate` reports Spearman, Pearson and
Kendall tau-b (``scipy.stats``), the least-squares line ``y ~ x`` with its R², bootstrap 95% percentile intervals
(resampling systems with replacement), and the systems whose rank differs between the two columns.
Rows with a missing value in either column are skipped and counted; values that are present but not numbers are
an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.data import PAPER_TABLE2  # noqa: F401  (the table ``alpacafarm compare paper`` reads)
from alpacafarm.errors import UserError
from alpacafarm.validation import Validator

MISSING = {"", "-", "na", "n/a", "nan", "none", "null"}


class RankCorrelationConfig(BaseModel):
    """Which columns to correlate and how to bootstrap."""

    model_config = ConfigDict(extra="forbid")

    x: str = Field(description="column on the x-axis (e.g. the simulated win-rate)")
    y: str = Field(description="column on the y-axis (e.g. the human win-rate)")
    n_bootstrap: int = Field(2000, ge=0, description="bootstrap resamples over systems (0: no intervals)")
    seed: int = 0
    name_column: str | None = Field(None,
                                    description="system names; default 'system' if present, else the first column")
    filters: dict[str, str] = Field(default_factory=dict, description="keep only rows where COLUMN equals VALUE")


@dataclass
class CorrelationResult:
    """Everything :func:`correlate` measured; ``to_json`` is the ``compare --json`` object."""

    x_name: str
    y_name: str
    names: list[str]
    x: np.ndarray
    y: np.ndarray
    spearman: float
    pearson: float
    kendall: float
    r2: float
    slope: float
    intercept: float
    n_skipped: int = 0
    skipped: list[str] = field(default_factory=list)
    intervals: dict[str, list[float]] = field(default_factory=dict)
    n_bootstrap_used: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.names)

    def to_json(self) -> dict[str, Any]:
        return {
            "x": self.x_name, "y": self.y_name,
            "spearman": self.spearman, "pearson": self.pearson, "kendall": self.kendall,
            "r2": self.r2, "slope": self.slope, "intercept": self.intercept,
            "n": self.n, "n_skipped": self.n_skipped, "skipped": self.skipped,
            "intervals": self.intervals, "n_bootstrap_used": self.n_bootstrap_used,
            "mismatches": self.mismatches,
        }


def _number(value: Any, row: int, column: str) -> float | None:
    """A cell as a float; ``None`` when missing. Raises UserError for text that is not a number."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool):
        raise UserError(f"row {row}: column {column!r}: expected a number, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    if text.lower() in MISSING:
        return None
    try:
        return float(text.rstrip("%"))
    except ValueError:
        raise UserError(f"row {row}: column {column!r}: expected a number, got {text!r}") from None


def _matches(cell: Any, wanted: str) -> bool:
    """Filter equality: as text, or as numbers so that ``1`` matches ``1.0``."""
    text = "" if cell is None else str(cell).strip()
    if text == wanted.strip():
        return True
    try:
        return float(text) == float(wanted)
    except ValueError:
        return False


def select_rows(records: list[dict[str, Any]],
                config: RankCorrelationConfig) -> tuple[list[str], np.ndarray, np.ndarray, list[str]]:
    """Names, x and y of the usable rows, and the names of rows skipped for a missing value."""
    columns = list(records[0]) if records else []
    wanted = [config.x, config.y, *config.filters]
    if config.name_column:
        wanted.append(config.name_column)
    for column in wanted:
        if column not in columns:
            raise UserError(f"no column {column!r} in the table; columns: {', '.join(map(repr, columns))}")
    name_column = config.name_column or ("system" if "system" in columns else columns[0])
    rows = [(i, r) for i, r in enumerate(records, start=1)
            if all(_matches(r.get(c), v) for c, v in config.filters.items())]
    names, xs, ys, skipped = [], [], [], []
    for number, record in rows:
        x, y = _number(record.get(config.x), number, config.x), _number(record.get(config.y), number, config.y)
        name = str(record.get(name_column) or f"row {number}")
        if x is None or y is None:
            skipped.append(name)
            continue
        names.append(name)
        xs.append(x)
        ys.append(y)
    return names, np.asarray(xs, float), np.asarray(ys, float), skipped


def ranks(values: np.ndarray) -> np.ndarray:
    """Rank 1 = highest value; tied values share the best rank (``1, 2, 2, 4``)."""
    from scipy.stats import rankdata

    return rankdata(-values, method="min").astype(int)


def _bootstrap(x: np.ndarray, y: np.ndarray, n_resamples: int, seed: int) -> tuple[dict[str, list[float]], int]:
    """95% percentile intervals of each metric over resampled systems, vectorised over resamples.

    Resamples in which x or y is constant are skipped: every correlation is undefined there.
    """
    from scipy.stats import rankdata

    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_resamples, len(x)))
    bx, by = x[idx], y[idx]
    keep = (np.ptp(bx, axis=1) > 0) & (np.ptp(by, axis=1) > 0)
    bx, by = bx[keep], by[keep]
    if len(bx) == 0:
        return {}, 0

    def pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a = a - a.mean(axis=1, keepdims=True)
        b = b - b.mean(axis=1, keepdims=True)
        return (a * b).sum(axis=1) / np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))

    r = pearson(bx, by)
    cx = bx - bx.mean(axis=1, keepdims=True)
    samples = {
        "spearman": pearson(rankdata(bx, axis=1), rankdata(by, axis=1)),
        "pearson": r,
        "kendall": np.concatenate([_kendall_b(bx[i:i + 256], by[i:i + 256]) for i in range(0, len(bx), 256)]),
        "r2": r * r,
        "slope": (cx * (by - by.mean(axis=1, keepdims=True))).sum(axis=1) / (cx * cx).sum(axis=1),
    }
    intervals = {k: [float(v) for v in np.percentile(s, [2.5, 97.5])] for k, s in samples.items()}
    return intervals, len(bx)


def _kendall_b(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall tau-b per row: sum of concordance signs over pairs, normalised by the untied pairs of each side."""
    sx = np.sign(x[:, :, None] - x[:, None, :])
    sy = np.sign(y[:, :, None] - y[:, None, :])
    # every unordered pair appears twice in the full matrices; the factor cancels in the ratio
    return (sx * sy).sum(axis=(1, 2)) / np.sqrt((sx != 0).sum(axis=(1, 2)) * (sy != 0).sum(axis=(1, 2)))


def correlate(records: list[dict[str, Any]], config: RankCorrelationConfig) -> CorrelationResult:
    """Correlate ``config.x`` with ``config.y`` over the table's rows (after ``config.filters``)."""
    from scipy import stats

    names, x, y, skipped = select_rows(records, config)
    if len(names) < 3:
        raise UserError(f"need at least 3 rows with both {config.x!r} and {config.y!r}; got {len(names)}"
                        f" ({len(skipped)} skipped for a missing value)")
    for column, values in ((config.x, x), (config.y, y)):
        if np.ptp(values) == 0:
            raise UserError(f"column {column!r} is constant over the selected rows; correlations are undefined")
    fit = stats.linregress(x, y)
    rank_x, rank_y = ranks(x), ranks(y)
    mismatches = [{"name": n, "rank_x": int(rx), "rank_y": int(ry), "x": float(a), "y": float(b)}
                  for n, rx, ry, a, b in zip(names, rank_x, rank_y, x, y, strict=True) if rx != ry]
    intervals, used = _bootstrap(x, y, config.n_bootstrap, config.seed) if config.n_bootstrap else ({}, 0)
    return CorrelationResult(
        x_name=config.x, y_name=config.y, names=names, x=x, y=y,
        spearman=float(stats.spearmanr(x, y).statistic), pearson=float(stats.pearsonr(x, y).statistic),
        kendall=float(stats.kendalltau(x, y, variant="b").statistic),
        r2=float(fit.rvalue ** 2), slope=float(fit.slope), intercept=float(fit.intercept),
        n_skipped=len(skipped), skipped=skipped, intervals=intervals, n_bootstrap_used=used, mismatches=mismatches,
    )


def plot(result: CorrelationResult, path: Path, title: str | None = None) -> Path:
    """A Figure-3-style scatter: one labelled point per system, the least-squares line and the y = x diagonal."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must happen before pyplot is imported
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6), dpi=120)
    try:
        ax.scatter(result.x, result.y, s=28, color="tab:blue", zorder=3)
        for name, a, b in zip(result.names, result.x, result.y, strict=True):
            ax.annotate(name, (a, b), textcoords="offset points", xytext=(4, 4), fontsize=8)
        low = float(min(result.x.min(), result.y.min()))
        high = float(max(result.x.max(), result.y.max()))
        pad = 0.05 * (high - low)
        grid = np.linspace(low - pad, high + pad, 2)
        ax.plot(grid, grid, linestyle=":", color="grey", label="y = x")
        ax.plot(grid, result.slope * grid + result.intercept, color="tab:red",
                label=f"fit: y = {result.slope:.2f}x {result.intercept:+.1f} (R² = {result.r2:.2f})")
        ax.set_xlabel(result.x_name)
        ax.set_ylabel(result.y_name)
        ax.set_title(title or f"Spearman {result.spearman:.2f}, Pearson {result.pearson:.2f}, n = {result.n}")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


class RankCorrelationValidator(Validator):
    """Registered validator ``rank_correlation``: ``validate(records)``; built by ``Registry.create``."""

    config_class = RankCorrelationConfig
    config: RankCorrelationConfig

    def validate(self, records: list[dict[str, Any]]) -> CorrelationResult:
        """Correlate the configured columns of ``records`` (one dict per system)."""
        return correlate(records, self.config)
