"""The evaluation's results table and plot: one row per system, and win-rate / proxy reward against n.

``results.csv`` and ``results.json`` hold the rows (system, n, win-rate ± SE, LC win-rate, wins/losses/draws,
avg length, proxy reward, and paired differences: to the sweep's smallest n, and to the first evaluated system
(the recipe's first ``evaluation.policy`` entry: the SFT model in the quickstart) with ``significant`` when that
difference exceeds 2 paired standard errors, and ``continuous_preferences`` when the judge gave a probability per
pair, i.e. the win-rates are weighted win-rates); ``results.png`` plots, for the systems that carry an ``n`` (a
best-of-n sweep), the win-rate with ± 1 SE bars and the proxy reward against n, with every other system as a
dashed reference line — the shape of the paper's Figure 5 / Figure 13.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alpacafarm.data import write_json

logger = logging.getLogger("alpacafarm")

COLUMNS = ("system", "stage", "n", "win_rate", "standard_error", "length_controlled_win_rate", "n_wins", "n_wins_base",
           "n_draws", "n_total", "avg_length", "proxy_reward", "delta_vs_smallest_n", "paired_standard_error",
           "vs_system", "delta_vs_system", "paired_se_vs_system", "significant", "continuous_preferences", "step",
           "train_reward", "gold", "gold_se", "delta_gold_vs_system", "paired_se_gold_vs_system", "kl", "kl_se",
           "retried_after_looks")
#: A paired difference counts as significant beyond this many paired standard errors (about p < 0.05, two-sided).
SIGNIFICANCE_SES = 2.0


def proxy_rewards(context: Any, systems: Sequence[tuple[Any, list[dict[str, Any]]]],
                  ensemble: tuple[str, float] = ("mean", 0.0)) -> list[float | None]:
    """Mean reward-model score of each system's judged outputs.

    A system whose stage recorded ``proxy_reward`` (best-of-n, scored with its reward model and its own ensemble
    rule) keeps it; the others are scored here with the run's ``reward_model`` input when there is one (an
    ensemble's members combined by ``ensemble``: rule, coefficient), else ``None``.
    """
    values: list[float | None] = [s.proxy_reward for s, _ in systems]
    missing = [i for i, v in enumerate(values) if v is None]
    if not missing or "reward_model" not in context.inputs:
        return values
    reward = context.reward_function(ensemble=ensemble[0], ensemble_coefficient=ensemble[1])
    with context.progress("proxy reward", len(missing)) as advance:
        for i in missing:
            pairs = systems[i][1]
            records = [{"instruction": p["instruction"], "input": p["input"]} for p in pairs]
            scores = reward(records, [p["output_2"] for p in pairs])
            values[i] = round(sum(scores) / len(scores), 6) if scores else None
            advance(1)
    return values


def paired_difference(scores: dict[str, float], baseline: dict[str, float],
                      scale: float = 100.0) -> tuple[float | None, float | None]:
    """Mean per-instruction score difference (x ``scale``: 100 gives points) on the instructions both judged, and
    its paired SE.

    Both systems answer the same instructions against the same references, so the difference of their
    win-rates is best judged per instruction: its standard error is much smaller than either win-rate's.
    """
    import math

    common = [k for k in scores if k in baseline]
    if not common:
        return None, None
    diffs = [scores[k] - baseline[k] for k in common]
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean * scale, None
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean * scale, math.sqrt(variance / len(diffs)) * scale


def results_rows(evaluated: Sequence[tuple[Any, dict[str, Any], dict[str, float]]],
                 rewards: Sequence[float | None], golds: Sequence[dict[str, float] | None] | None = None,
                 kls: Sequence[tuple[float, float | None] | None] | None = None) -> list[dict[str, Any]]:
    """One row per system, in the evaluation's order; ``evaluated`` holds (system, metrics, per-instruction scores).

    Systems with an ``n`` (a best-of-n sweep) also get their paired difference to the sweep's smallest n. Every
    system after the first gets its paired difference to the first (``vs_system``) and ``significant``: whether
    ``|Δ| > 2`` paired SE (None when the SE is undefined; a difference with zero spread counts when non-zero).
    ``golds``: per system, its per-instruction gold score when the judge scores answers (the gold world), giving
    ``gold`` ± SE and the paired difference to the first system; ``kls``: per system, its KL to the reference
    model ± SE where known.
    """
    golds = golds if golds is not None else [None] * len(evaluated)
    kls = kls if kls is not None else [None] * len(evaluated)
    first_gold = golds[0] if golds else None
    first_name, first_scores = (evaluated[0][0].name, evaluated[0][2]) if evaluated else (None, {})
    sweeps: dict[str, tuple[int, dict[str, float]]] = {}
    for system, _, scores in evaluated:
        n = system.n
        if n is not None and (system.stage not in sweeps or n < sweeps[system.stage][0]):
            sweeps[system.stage] = (n, scores)
    rows = []
    for (system, metrics, scores), reward, gold, kl in zip(evaluated, rewards, golds, kls, strict=True):
        delta = paired_se = None
        if system.n is not None:
            delta, paired_se = paired_difference(scores, sweeps[system.stage][1])
        versus = {"vs_system": None, "delta_vs_system": None, "paired_se_vs_system": None, "significant": None}
        if rows:  # not the first system itself
            diff, se = paired_difference(scores, first_scores)
            versus = {"vs_system": first_name, "delta_vs_system": diff, "paired_se_vs_system": se,
                      "significant": significant(diff, se)}
        rows.append({"system": system.name, "stage": system.stage, "n": system.n,
                     **{k: metrics.get(k) for k in COLUMNS[3:11]}, "proxy_reward": reward,
                     "delta_vs_smallest_n": delta, "paired_standard_error": paired_se, **versus,
                     "continuous_preferences": bool(metrics.get("continuous_preferences")),
                     "step": system.step, "train_reward": system.train_reward,
                     **gold_columns(gold, first_gold if rows else None),
                     "kl": kl[0] if kl else None, "kl_se": kl[1] if kl else None, "retried_after_looks": None})
    return rows


def gold_columns(gold: dict[str, float] | None, first: dict[str, float] | None) -> dict[str, float | None]:
    """``gold`` (mean gold score) ± ``gold_se``, and its paired difference to the first system ± paired SE."""
    import math

    empty = {"gold": None, "gold_se": None, "delta_gold_vs_system": None, "paired_se_gold_vs_system": None}
    if not gold:
        return empty
    values = list(gold.values())
    mean = sum(values) / len(values)
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) if len(values) > 1 \
        else None
    delta, paired_se = paired_difference(gold, first, scale=1.0) if first else (None, None)
    return {"gold": mean, "gold_se": se, "delta_gold_vs_system": delta, "paired_se_gold_vs_system": paired_se}


def significant(delta: float | None, paired_se: float | None) -> bool | None:
    """``|Δ| > 2`` paired SE; None when there is no difference or no SE (fewer than 2 common instructions)."""
    if delta is None or paired_se is None:
        return None
    return abs(delta) > SIGNIFICANCE_SES * paired_se if paired_se > 0 else delta != 0


def results_table(rows: list[dict[str, Any]], title: str) -> dict[str, Any]:
    """The printable results table (``{"title", "columns", "rows"}``), narrow enough for an 80-column screen:
    win-rates, the paired difference to the first system ``Δ ± paired SE`` with ``*`` where it is significant
    (|Δ| > 2 paired SE), and the sweep's difference to n₀. Every figure is also in results.csv. With a judge's
    continuous preferences (a probability per pair) the win-rates are weighted win-rates, and the column says so."""
    def fmt(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def delta(value: Any, se: Any, mark: str = "") -> str:
        return "-" if value is None else f"{value:+.1f} ± {fmt(se, 1)}{mark}"

    first = rows[0]["system"] if rows else "first"
    rate = "weighted win-rate %" if any(r.get("continuous_preferences") for r in rows) else "win-rate %"
    columns = ["system", "n", rate, "± SE", "avg len", "proxy rwd", f"Δ vs {first}", "Δ vs n₀"]
    body = [[r["system"] + (" ‡" if r.get("retried_after_looks") else ""), r["n"] if r["n"] is not None else "-",
             fmt(r["win_rate"]), fmt(r["standard_error"]),
             fmt(r["avg_length"], 0), fmt(r["proxy_reward"], 3),
             delta(r.get("delta_vs_system"), r.get("paired_se_vs_system"), " *" if r.get("significant") else ""),
             delta(r["delta_vs_smallest_n"], r["paired_standard_error"])] for r in rows]
    if any(r.get("gold") is not None for r in rows):  # the gold world: mean gold score, Δ gold, KL to the SFT model
        columns += ["gold", "Δ gold", "KL"]
        for line, r in zip(body, rows, strict=True):
            change = r.get("delta_gold_vs_system")
            line += [fmt(r.get("gold"), 3),
                     "-" if change is None else f"{change:+.3f} ± {fmt(r.get('paired_se_gold_vs_system'), 3)}",
                     fmt(r.get("kl"), 2)]
    return {"title": f"{title}; Δ ± paired SE, * beyond {SIGNIFICANCE_SES:g} SE", "columns": columns, "rows": body}


def write_results(rows: list[dict[str, Any]], directory: Path, looks: dict[str, Any] | None = None) -> dict[str, str]:
    """``results.csv``, ``results.json``, ``results.png`` when some row has an ``n`` (the curve against n), and
    ``systems.png`` when there are several systems (win-rate ± SE per system), ``over_training.png`` when systems
    carry a training ``step`` (policy snapshots); returns their paths."""
    files = {"csv": str(directory / "results.csv"), "json": str(directory / "results.json")}
    with open(files["csv"], "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    write_json(Path(files["json"]), {"columns": list(COLUMNS), "rows": rows, "looks": looks})
    if any(r["n"] is not None for r in rows):
        files["png"] = str(directory / "results.png")
        plot_curve(rows, Path(files["png"]))
    if len([r for r in rows if r["win_rate"] is not None]) > 1:
        files["systems_png"] = str(directory / "systems.png")
        plot_systems(rows, Path(files["systems_png"]))
    if any(r.get("step") is not None for r in rows):
        files["over_training_png"] = str(directory / "over_training.png")
        plot_over_training(rows, Path(files["over_training_png"]))
    if kl_curves(rows):
        files["gold_vs_kl_png"] = str(directory / "gold_vs_kl.png")
        plot_gold_vs_kl(rows, Path(files["gold_vs_kl_png"]))
    return files


def kl_curves(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The curves ``gold_vs_kl.png`` draws: per stage, its rows with a gold score and a KL (a best-of-n sweep over
    n, a policy's snapshots over steps), in KL order, when a stage has at least two such rows."""
    stages: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("gold") is not None and row.get("kl") is not None:
            stages.setdefault(row["stage"], []).append(row)
    return {stage: sorted(points, key=lambda r: r["kl"]) for stage, points in stages.items() if len(points) > 1}


def kl_deltas(rows: list[dict[str, Any]]) -> tuple[str | None, dict[str, list[tuple[float, float, float]]]]:
    """What the middle panel of ``gold_vs_kl.png`` draws: the system every gold difference is read against (the
    table's first, ``vs_system``) and, per curve of :func:`kl_curves`, its points as (KL, Δ gold, paired SE); the
    first system is its own curve's point (Δ 0, SE 0), rows without a paired difference are left out. Paired
    bands are much narrower than each mean's own SE, so differences between curves show where they are real."""
    first = next((r["vs_system"] for r in rows if r.get("vs_system")), None)
    deltas: dict[str, list[tuple[float, float, float]]] = {}
    for stage, points in kl_curves(rows).items():
        shown = [(r["kl"], 0.0, 0.0) if r["system"] == first else
                 (r["kl"], r["delta_gold_vs_system"], r.get("paired_se_gold_vs_system") or 0.0)
                 for r in points if r["system"] == first or r.get("delta_gold_vs_system") is not None]
        if shown:
            deltas[stage] = shown
    return first, deltas


def plot_gold_vs_kl(rows: list[dict[str, Any]], path: Path) -> None:
    """Gold score (± SE band, left), its paired difference to the table's first system (± paired SE, middle, where
    the evaluation computed one: :func:`kl_deltas`) and proxy reward (right) against the KL to the SFT model, one
    curve per stage (Gao et al. 2023, Figure 1; Coste et al. 2024): over-optimisation shows as a gold curve that
    turns down while the proxy keeps rising. The proxy is each stage's own reward where recorded
    (``train_reward``, a policy's mean rollout reward since the snapshot before), else the evaluation's proxy
    reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = kl_curves(rows)
    first, deltas = kl_deltas(rows)
    fig, axes = plt.subplots(1, 3 if deltas else 2, figsize=(15 if deltas else 10, 4))
    left, right = axes[0], axes[-1]
    try:
        for stage, points in curves.items():
            kl = [r["kl"] for r in points]
            gold = [r["gold"] for r in points]
            se = [r.get("gold_se") or 0.0 for r in points]
            line = left.plot(kl, gold, marker="o", label=stage)[0]
            left.fill_between(kl, [g - e for g, e in zip(gold, se, strict=True)],
                              [g + e for g, e in zip(gold, se, strict=True)], color=line.get_color(), alpha=0.15)
            if stage in deltas:
                x, d, e = (list(v) for v in zip(*deltas[stage], strict=True))
                axes[1].plot(x, d, marker="o", color=line.get_color(), label=stage)
                axes[1].fill_between(x, [a - s for a, s in zip(d, e, strict=True)],
                                     [a + s for a, s in zip(d, e, strict=True)], color=line.get_color(), alpha=0.15)
            key = "train_reward" if all(r.get("train_reward") is not None for r in points) else "proxy_reward"
            shown = [r for r in points if r.get(key) is not None]
            right.plot([r["kl"] for r in shown], [r[key] for r in shown], marker="s", color=line.get_color(),
                       label=stage)
        left.set_xlabel("KL to the SFT model (nats)")
        left.set_ylabel("mean gold score ± SE")
        if deltas:
            axes[1].axhline(0.0, linestyle="--", linewidth=1, color="#555555")
            axes[1].set_xlabel("KL to the SFT model (nats)")
            axes[1].set_ylabel(f"Δ gold vs {first} ± paired SE")
            axes[1].legend(fontsize=8)
        right.set_xlabel("KL to the SFT model (nats)")
        right.set_ylabel("proxy reward (the reward model)")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
        fig.suptitle("gold and proxy reward against KL")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def over_training_lines(rows: list[dict[str, Any]]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any] | None]:
    """What ``over_training.png`` draws: the rows of each stage whose systems carry a ``step``, in step order, and
    the starting point they are read against: the table's first system when it has no step (in a recipe such as
    ``recipes/overoptimization.yaml``, the SFT model every run starts from), else None."""
    stages: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("step") is not None and row["win_rate"] is not None:
            stages.setdefault(row["stage"], []).append(row)
    for points in stages.values():
        points.sort(key=lambda r: r["step"])
    first = next((r for r in rows if r["win_rate"] is not None), None)
    start = first if first is not None and first.get("step") is None else None
    return stages, start


def plot_over_training(rows: list[dict[str, Any]], path: Path) -> None:
    """Win-rate (± SE, left) and reward (right) against the training step, one line per stage whose systems carry
    a ``step`` (the paper's Figure 5: over-optimisation shows as a win-rate that turns down while the proxy reward
    keeps rising), the starting system (:func:`over_training_lines`) as a dashed line with its ± SE band. The reward
    is each stage's own training reward there (``train_reward``: PPO's mean rollout reward since the snapshot
    before, under the reward model it optimises) where recorded, else the evaluation's proxy reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages, start = over_training_lines(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    try:
        for stage, points in stages.items():
            left.errorbar([r["step"] for r in points], [r["win_rate"] for r in points],
                          yerr=[r["standard_error"] or 0.0 for r in points], marker="o", capsize=3, label=stage)
            own = all(r.get("train_reward") is not None for r in points)
            key = "train_reward" if own else "proxy_reward"
            rewarded = [r for r in points if r[key] is not None]
            right.plot([r["step"] for r in rewarded], [r[key] for r in rewarded], marker="s",
                       label=f"{stage} ({'its training reward' if own else 'proxy reward'})")
        if start is not None:
            se = start["standard_error"] or 0.0
            left.axhline(start["win_rate"], linestyle="--", linewidth=1, color="#555555",
                         label=f"{start['system']} (start) ± SE")
            left.axhspan(start["win_rate"] - se, start["win_rate"] + se, color="#555555", alpha=0.12)
        rate = "weighted win-rate" if any(r.get("continuous_preferences") for r in rows) else "win-rate"
        left.set_xlabel("training step")
        left.set_ylabel(f"{rate} vs reference (%) ± SE")
        right.set_xlabel("training step")
        right.set_ylabel("mean reward (reward model)")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
        fig.suptitle("win-rate and proxy reward over training")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def plot_systems(rows: list[dict[str, Any]], path: Path) -> None:
    """One horizontal bar per system, in the table's order: win-rate ± SE, the first system's win-rate as a dashed
    line, and each other bar labelled with its paired difference to it (``*`` and a dark bar beyond 2 paired SE)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["win_rate"] is not None]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(shown) + 1.6))
    try:
        ys = list(range(len(shown)))[::-1]
        colors = ["#4C72B0" if r.get("significant") else "#A6B8D6" for r in shown]
        ax.barh(ys, [r["win_rate"] for r in shown], xerr=[r["standard_error"] or 0.0 for r in shown],
                color=colors, capsize=3)
        ax.set_yticks(ys, [r["system"] for r in shown], fontsize=8)
        ax.axvline(shown[0]["win_rate"], linestyle="--", linewidth=1, color="#555555")
        for y, row in zip(ys, shown, strict=True):
            if row.get("delta_vs_system") is not None:
                se = row.get("paired_se_vs_system")
                text = f"{row['delta_vs_system']:+.1f}" + (f" ± {se:.1f}" if se is not None else "")
                ax.text(row["win_rate"] + (row["standard_error"] or 0.0) + 0.5, y,
                        text + (" *" if row.get("significant") else ""), va="center", fontsize=7)
        rate = "weighted win-rate" if any(r.get("continuous_preferences") for r in shown) else "win-rate"
        ax.set_xlabel(f"{rate} vs reference (%) ± SE; labels: Δ vs {shown[0]['system']} ± paired SE "
                      f"(* beyond {SIGNIFICANCE_SES:g})", fontsize=8)
        ax.set_xlim(0, max(r["win_rate"] + (r["standard_error"] or 0.0) for r in shown) * 1.25 + 1)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def plot_curve(rows: list[dict[str, Any]], path: Path) -> None:
    """Win-rate (± SE) and proxy reward against n (log scale), other systems as dashed horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never open a window
    import matplotlib.pyplot as plt

    curve = sorted((r for r in rows if r["n"] is not None and r["win_rate"] is not None), key=lambda r: r["n"])
    others = [r for r in rows if r["n"] is None and r["win_rate"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        ns = [r["n"] for r in curve]
        ax.errorbar(ns, [r["win_rate"] for r in curve], yerr=[r["standard_error"] or 0.0 for r in curve],
                    marker="o", capsize=3, color="#4C72B0", label="best-of-n win-rate")
        colors = ["#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3"]
        for i, row in enumerate(others):
            ax.axhline(row["win_rate"], linestyle="--", linewidth=1, color=colors[i % len(colors)],
                       label=f"{row['system']} {row['win_rate']:.1f}%")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("n (samples per instruction)")
        ax.set_ylabel("win-rate vs reference (%) ± SE")
        handles, labels = ax.get_legend_handles_labels()
        if any(r["proxy_reward"] is not None for r in curve):
            right = ax.twinx()
            shown = [r for r in curve if r["proxy_reward"] is not None]
            right.plot([r["n"] for r in shown], [r["proxy_reward"] for r in shown], marker="s", color="#8C8C8C",
                       label="proxy reward (reward model)")
            right.set_ylabel("mean proxy reward")
            extra_handles, extra_labels = right.get_legend_handles_labels()
            handles, labels = handles + extra_handles, labels + extra_labels
        ax.legend(handles, labels, loc="best", fontsize=8)
        ax.set_title("win-rate and proxy reward against n")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
