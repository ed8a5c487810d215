"""Win-rate metrics from pairwise preferences, defined exactly as AlpacaEval's leaderboards compute them.

Conventions (AlpacaEval): ``output_1`` is the reference, ``output_2`` the evaluated system. A preference is
1 (reference wins), 2 (system wins), 0 (tie), a continuous value in [1, 2] (AlpacaEval 2's logprob-weighted
judge: 1.5 is a tie), or None/NaN (the judge's answer could not be parsed: dropped and counted).

Each parsed preference ``p`` becomes a score ``s = p - 1`` in [0, 1] (a tie, 0, scores 0.5). Then, as in the
AlpacaEval CSVs (checked to 1e-12 against ``alpaca_eval_gpt4_leaderboard.csv``):

* ``win_rate`` = 100 · mean(s) (with continuous preferences, AlpacaEval 2's weighted win-rate, and
  ``continuous_preferences`` is true); ``standard_error`` = 100 · std(s, ddof=1) / sqrt(n) (the sample standard
  deviation: pandas' ``sem``);
* ``n_wins`` = #(p > 1.5), ``n_wins_base`` = #(1 <= p < 1.5), ``n_draws`` = #(p == 0 or p == 1.5), ``n_total``
  = the number of parsed preferences; ``discrete_win_rate`` = 100 · (n_wins + n_draws / 2) / n_total;
* ``avg_length`` = int(mean(len(output_2))) over every record, parsed or not (truncated, not rounded: that is
  what reproduces the CSV's column, e.g. 1018 for a mean of 1018.57).

``length_controlled_win_rate`` is a documented simplification of AlpacaEval 2's length-controlled GLM: see
:func:`length_controlled_win_rate`. Only numpy and scipy are used (imported inside the functions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: Ridge penalty on the length slope only; keeps the fit finite when wins are perfectly separated by length.
LC_SLOPE_PENALTY = 1e-3
UNKNOWN_SOURCE = "unknown"


def _score(preference: Any) -> float | None:
    """The score in [0, 1] of one preference, None when unparsed; ValueError for anything else."""
    if preference is None:
        return None
    if isinstance(preference, bool) or not isinstance(preference, int | float):
        raise ValueError(f"preference must be a number or null, got {preference!r}")
    value = float(preference)
    if math.isnan(value):
        return None
    if value == 0.0:
        return 0.5
    if not 1.0 <= value <= 2.0:
        raise ValueError(f"preference must be 0 (tie), in [1, 2] or null, got {preference!r}")
    return value - 1.0


def scores(preferences: Sequence[Any]) -> list[float | None]:
    """Scores in [0, 1] (system wins = 1) for each preference; None where unparsed."""
    return [_score(p) for p in preferences]


def _summary(values: list[float], raw: list[Any]) -> dict[str, Any]:
    """The counts and rates of one group of parsed preferences (``raw`` are the matching preferences)."""
    import numpy as np

    n = len(values)
    wins = sum(1 for p in raw if float(p) > 1.5)
    draws = sum(1 for p in raw if float(p) in (0.0, 1.5))
    base = n - wins - draws
    if n == 0:
        return {"win_rate": None, "standard_error": None, "n_wins": 0, "n_wins_base": 0, "n_draws": 0,
                "n_total": 0, "discrete_win_rate": None}
    array = np.asarray(values, dtype=float)
    # std(ddof=1) is undefined for one value; report 0 spread rather than NaN (JSON has no NaN).
    se = float(array.std(ddof=1) / math.sqrt(n)) * 100 if n > 1 else 0.0
    return {"win_rate": float(array.mean()) * 100, "standard_error": se, "n_wins": wins, "n_wins_base": base,
            "n_draws": draws, "n_total": n, "discrete_win_rate": (wins + draws / 2) / n * 100}


def length_controlled_win_rate(values: Sequence[float], length_differences: Sequence[float]) -> float | None:
    """The win-rate (percent) a logistic model predicts when the system's output is as long as the reference's.

    A simplified AlpacaEval 2 length control: AlpacaEval 2 fits, per system, a GLM on tanh of the standardized
    length difference plus instruction-difficulty terms and reads off the win-rate at zero length difference.
    Here the model is only ``P(system wins) = sigmoid(b + w · tanh(d / std(d)))`` with ``d = len(output_2) -
    len(output_1)`` and ``std`` the sample standard deviation of ``d``; it is fitted by maximum likelihood with
    the scores as (soft) targets, a tiny ridge penalty on ``w`` only, and the result is ``100 · sigmoid(b)``.
    With all lengths equal the model reduces to its intercept and the result is exactly the raw win-rate.
    Returns None without data.
    """
    import numpy as np

    y = np.asarray(values, dtype=float)
    d = np.asarray(length_differences, dtype=float)
    if y.size == 0:
        return None
    mean = float(y.mean())
    spread = float(d.std(ddof=1)) if d.size > 1 else 0.0
    if mean in (0.0, 1.0) or spread == 0.0:  # all wins / all losses / no length signal: intercept-only model
        return mean * 100
    x = np.tanh(d / spread)
    from scipy.optimize import minimize
    from scipy.special import expit, log_expit

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        b, w = theta
        z = b + w * x
        nll = -np.mean(y * log_expit(z) + (1 - y) * log_expit(-z)) + 0.5 * LC_SLOPE_PENALTY * w * w
        residual = expit(z) - y
        return float(nll), np.array([residual.mean(), (residual * x).mean() + LC_SLOPE_PENALTY * w])

    start = np.array([math.log(mean / (1 - mean)), 0.0])
    fit = minimize(loss, start, jac=True, method="L-BFGS-B", options={"gtol": 1e-10, "ftol": 1e-14, "maxiter": 500})
    return float(expit(fit.x[0])) * 100


def compute_metrics(preferences: Sequence[Any], output_lengths: Sequence[int] | None = None,
                    reference_lengths: Sequence[int] | None = None,
                    sources: Sequence[str | None] | None = None) -> dict[str, Any]:
    """All win-rate metrics of one system: overall, per source (``dataset``) and length-controlled.

    ``output_lengths`` are the evaluated outputs' lengths in characters (for ``avg_length``); with
    ``reference_lengths`` too, the length-controlled win-rate is computed. ``sources`` name each example's
    subset (selfinstruct, oasst, koala, helpful_base, vicuna); missing names are grouped as ``unknown``.
    """
    n = len(preferences)
    for name, seq in (("output_lengths", output_lengths), ("reference_lengths", reference_lengths),
                      ("sources", sources)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries for {n} preferences")
    all_scores = scores(preferences)
    parsed = [i for i, s in enumerate(all_scores) if s is not None]
    metrics = _summary([all_scores[i] for i in parsed], [preferences[i] for i in parsed])
    metrics["n_unparsed"] = n - len(parsed)
    # a logprob-weighted judge's preferences (AlpacaEval 2): win_rate is then the weighted win-rate
    metrics["continuous_preferences"] = any(float(preferences[i]) not in (0.0, 1.0, 2.0) for i in parsed)
    metrics["avg_length"] = int(sum(output_lengths) / n) if output_lengths is not None and n else None
    lc = None
    if output_lengths is not None and reference_lengths is not None:
        lc = length_controlled_win_rate([all_scores[i] for i in parsed],
                                        [output_lengths[i] - reference_lengths[i] for i in parsed])
    metrics["length_controlled_win_rate"] = lc
    per_source: dict[str, dict[str, Any]] = {}
    if sources is not None and any(sources):
        groups: dict[str, list[int]] = {}
        for i in parsed:
            groups.setdefault(sources[i] or UNKNOWN_SOURCE, []).append(i)
        for source in sorted(groups):
            idx = groups[source]
            per_source[source] = _summary([all_scores[i] for i in idx], [preferences[i] for i in idx])
    metrics["per_source"] = per_source
    return metrics


def metrics_from_annotations(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of AlpacaEval-format judged pairs (``preference``, ``output_1`` = reference, ``output_2`` = system,
    optional ``dataset``). Raises ValueError naming the first bad record."""
    preferences, out_lengths, ref_lengths, sources = [], [], [], []
    have_lengths = True
    for i, record in enumerate(records):
        if not isinstance(record, dict) or "preference" not in record:
            raise ValueError(f"record {i} has no 'preference'")
        try:
            _score(record["preference"])
        except ValueError as exc:
            raise ValueError(f"record {i}: {exc}") from None
        preferences.append(record["preference"])
        sources.append(record.get("dataset") if isinstance(record.get("dataset"), str) else None)
        out, ref = record.get("output_2"), record.get("output_1")
        if isinstance(out, str) and isinstance(ref, str):
            out_lengths.append(len(out))
            ref_lengths.append(len(ref))
        else:
            have_lengths = False
    metrics = compute_metrics(preferences, out_lengths if have_lengths else None,
                              ref_lengths if have_lengths else None, sources)
    generators = {r.get("generator_2") for r in records if isinstance(r, dict)} - {None}
    metrics["generator"] = generators.pop() if len(generators) == 1 else None
    return metrics


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def metrics_table(metrics: dict[str, Any], title: str) -> dict[str, Any]:
    """A printable table (``{"title", "columns", "rows"}``): the overall row, then one row per source."""
    rate = "weighted win-rate %" if metrics.get("continuous_preferences") else "win-rate %"
    columns = ["subset", rate, "± SE", "LC win-rate %", "wins", "losses", "draws", "n", "unparsed",
               "avg length"]
    rows = [["all", _fmt(metrics["win_rate"]), _fmt(metrics["standard_error"]),
             _fmt(metrics.get("length_controlled_win_rate")), metrics["n_wins"], metrics["n_wins_base"],
             metrics["n_draws"], metrics["n_total"], metrics["n_unparsed"], _fmt(metrics.get("avg_length"))]]
    for source, sub in metrics.get("per_source", {}).items():
        rows.append([source, _fmt(sub["win_rate"]), _fmt(sub["standard_error"]), "-", sub["n_wins"],
                     sub["n_wins_base"], sub["n_draws"], sub["n_total"], "-", "-"])
    return {"title": title, "columns": columns, "rows": rows}
