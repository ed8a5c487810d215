"""What a labelling session says about the simulators: agreement with the people, on the people's pairs.

Given the human labels of a session (``alpacafarm label``) and one or several simulated annotators' labels of the
same pairs (matched on instruction, output_1, output_2, in canonical orientation), :func:`build_report` measures:

* **human-human agreement** on the pairs labelled by 2 or more people (the overlap): each human label against the
  majority of the other people's labels of the pair (:func:`alpacafarm_validation.agreement.measure`, the paper's
  held-out definition; with 2 labellers, the rate at which they agree). The paper reports 65.7% for its crowd
  workers. Cohen's kappa among humans is Light's kappa: the mean over labeller pairs of Cohen's kappa on the pairs
  both labelled.
* **each simulator's agreement with the humans**: every human label scored against the simulator's label(s) of the
  pair (1 same side, 0 opposite, 0.5 when exactly one is a tie), averaged over human labels; so a simulator that
  agrees with people as often as people agree with each other scores about the human-human agreement. On the
  overlap pairs, also against the held-out human majority (comparable to the human-human figure). Cohen's kappa
  between the simulator's label and each human label (ties a third category; exact matches only).
* **P(prefers longer)**: among labels that pick a side on pairs of unequal length, the share picking the longer.
* **win-rates per system and their Spearman correlation** (humans vs each simulator, bootstrap 95% interval over
  systems), when the pairs name their systems and 3 or more remain after leaving out a system present in every
  pair (the common reference, whose win-rate only mirrors the others'). A system's win-rate: the share of its
  labelled comparisons it won, a tie counting one half; the simulator's is measured on the same pairs.

Agreement and kappa carry 95% bootstrap intervals over pairs (:mod:`alpacafarm_validation.label_stats`), and the
report warns when fewer than ``MIN_SHARED_PAIRS`` pairs have labels from 2 or more people. The humans' row is on
the shared pairs' labels throughout (agreement, kappa and P(prefers longer) on the same labels).

Skipped pairs are not labels (counted apart); "both bad" counts as a tie. Numbers are fractions in [0, 1]
(win-rates in %).
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm_validation.agreement import (
    TIE,
    AgreementConfig,
    PairKey,
    group,
    measure,
    mode,
    parse_label,
    preference_shares,
    score,
)
from alpacafarm_validation.label_stats import (
    MIN_SHARED_PAIRS,
    cohen_kappa,
    human_intervals,
    shared_pairs_warning,
    simulator_intervals,
)

__all__ = ["PAPER_HUMAN_AGREEMENT", "build_report", "cohen_kappa", "labels_from_file", "plot"]

#: Human-human agreement the AlpacaFarm paper measured for its crowd workers (Dubois et al. 2023, §4.3).
PAPER_HUMAN_AGREEMENT = 0.657


def _key(row: dict[str, Any]) -> PairKey:
    return (str(row["instruction"]), str(row["output_1"]), str(row["output_2"]))


def human_by_pair(rows: list[dict[str, Any]]) -> dict[PairKey, list[tuple[str, float]]]:
    """(labeller, label) of every non-skipped human label, grouped by pair."""
    out: dict[PairKey, list[tuple[str, float]]] = {}
    for row in rows:
        label = parse_label(row["preference"], f"label of {row['labeller']} on pair {row['pair_id']}")
        if label is not None:
            out.setdefault(_key(row), []).append((row["labeller"], label))
    return out


def light_kappa(humans: dict[PairKey, list[tuple[str, float]]]) -> dict[str, Any]:
    """Mean over labeller pairs of Cohen's kappa on the pairs both labelled (pairs of labellers whose kappa is
    undefined are left out and counted)."""
    by_labeller: dict[str, dict[PairKey, float]] = {}
    for key, labels in humans.items():
        for labeller, label in labels:
            by_labeller.setdefault(labeller, {})[key] = label
    kappas, undefined = [], 0
    for a, b in itertools.combinations(sorted(by_labeller), 2):
        shared = sorted(set(by_labeller[a]) & set(by_labeller[b]))
        kappa = cohen_kappa([by_labeller[a][k] for k in shared], [by_labeller[b][k] for k in shared])
        if kappa is None:
            undefined += bool(shared)
        else:
            kappas.append(kappa)
    return {"kappa": sum(kappas) / len(kappas) if kappas else None, "labeller_pairs": len(kappas),
            "labeller_pairs_undefined": undefined}


def label_records(labels: dict[PairKey, list[float]]) -> list[dict[str, Any]]:
    return [{"instruction": k[0], "output_1": k[1], "output_2": k[2], "preference": 0 if v == TIE else v}
            for k, values in labels.items() for v in values]


def simulator_row(humans: dict[PairKey, list[tuple[str, float]]], labels: dict[PairKey, list[float]],
                  seed: int, n_bootstrap: int = 2000) -> dict[str, Any]:
    """Agreement, kappa (each with a bootstrap interval over pairs) and P(prefers longer) of one simulator's
    labels against the human labels."""
    scores, human_side, sim_side = [], [], []
    units: list[tuple[list[float], list[tuple[float, float]]]] = []
    matched = {k: v for k, v in labels.items() if k in humans and v}
    for key, values in matched.items():
        typical = mode(values, seed, "simulator", *key)
        unit: tuple[list[float], list[tuple[float, float]]] = ([], [])
        for _, human in humans[key]:
            scores.append(sum(score(v, human) for v in values) / len(values))
            human_side.append(human)
            sim_side.append(typical)
            unit[0].append(scores[-1])
            unit[1].append((human, typical))
        units.append(unit)
    if not scores:
        raise UserError("none of the simulator's labels is on a pair the humans labelled")
    overlap = {k: [label for _, label in v] for k, v in humans.items() if len(v) >= 2}
    held_out = None
    if any(k in matched for k in overlap):
        result = measure(label_records(overlap), AgreementConfig(seed=seed), label_records(matched))
        held_out = result.annotator["agreement"] if result.annotator else None
    return {"agreement": sum(scores) / len(scores), "n_human_labels": len(scores), "pairs": len(matched),
            "agreement_overlap_majority": held_out, "kappa": cohen_kappa(human_side, sim_side),
            **simulator_intervals(units, seed, n_bootstrap), **preference_shares(matched, 0)}


def win_rates(humans: dict[PairKey, list[tuple[str, float]]], systems: dict[PairKey, tuple[str, str]],
              labels: dict[PairKey, list[float]] | None, *, standard_errors: bool = False) -> dict[str, float]:
    """Win-rate (%) of each system from the human labels (``labels`` None) or a simulator's, on the pairs both
    labelled; a tie counts one half. With ``standard_errors``: each win-rate's standard error (%) instead,
    ``sqrt(p (1 - p) / n)`` over the system's n comparisons (the plot's error bars)."""
    won: Counter[str] = Counter()
    played: Counter[str] = Counter()
    for key, people in humans.items():
        if key not in systems:
            continue
        values = [label for _, label in people] if labels is None else labels.get(key) or []
        one, two = systems[key]
        for value in values:
            played[one] += 1
            played[two] += 1
            won[one] += 1.0 if value == 1.0 else 0.5 if value == TIE else 0.0
            won[two] += 1.0 if value == 2.0 else 0.5 if value == TIE else 0.0
    if standard_errors:
        return {s: 100.0 * (won[s] / played[s] * (1 - won[s] / played[s]) / played[s]) ** 0.5 for s in sorted(played)}
    return {s: 100.0 * won[s] / played[s] for s in sorted(played)}


def spearman_over_pairs(humans: dict[PairKey, list[tuple[str, float]]], systems: dict[PairKey, tuple[str, str]],
                        labels: dict[PairKey, list[float]], left_out: set[str], n_bootstrap: int,
                        seed: int) -> list[float] | None:
    """95% percentile interval of the win-rates' Spearman rho, resampling the labelled *pairs* (the humans' and
    the simulator's labels of a pair move together), every system's win-rates recomputed on each resample; None
    when fewer than half the resamples leave 3 systems with varying win-rates. Resampling the systems instead (4
    systems: 4 points) gave [1.00, 1.00] for any perfect ordering, however few pairs it rested on."""
    import random

    from scipy import stats

    keys = [k for k in humans if k in systems]
    rng = random.Random(seed)
    values: list[float] = []
    for _ in range(n_bootstrap):
        draw = [(keys[rng.randrange(len(keys))], j) for j in range(len(keys))]
        drawn_humans = {(k, j): humans[k] for k, j in draw}
        drawn_systems = {(k, j): systems[k] for k, j in draw}
        human = win_rates(drawn_humans, drawn_systems, None)
        simulated = win_rates(drawn_humans, drawn_systems, {(k, j): labels.get(k) or [] for k, j in draw})
        common = [s for s in human if s in simulated and s not in left_out]
        x, y = [simulated[s] for s in common], [human[s] for s in common]
        if len(common) >= 3 and len(set(x)) > 1 and len(set(y)) > 1:
            values.append(float(stats.spearmanr(x, y).statistic))
    if len(values) < n_bootstrap / 2:
        return None
    values.sort()
    return [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]


def correlation(humans: dict[PairKey, list[tuple[str, float]]], systems: dict[PairKey, tuple[str, str]],
                sims: dict[str, dict[PairKey, list[float]]], n_bootstrap: int, seed: int) -> dict[str, Any] | None:
    """Per-system win-rates of the humans and each simulator, and Spearman's rho (bootstrap interval) of each
    simulator's against the humans'; None when the pairs name no systems."""
    from alpacafarm_validation.correlations import RankCorrelationConfig, correlate

    labelled = [systems[k] for k in humans if k in systems]
    if not labelled:
        return None
    everywhere = set.intersection(*(set(s) for s in labelled))
    human_rates = {s: r for s, r in win_rates(humans, systems, None).items() if s not in everywhere}
    out: dict[str, Any] = {"left_out": sorted(everywhere), "humans": human_rates, "simulators": {},
                           "humans_se": {s: e for s, e in win_rates(humans, systems, None, standard_errors=True).items()
                                         if s in human_rates}}
    for name, labels in sims.items():
        rates = {s: r for s, r in win_rates(humans, systems, labels).items() if s not in everywhere}
        entry: dict[str, Any] = {"win_rates": rates, "win_rate_se": {
            s: e for s, e in win_rates(humans, systems, labels, standard_errors=True).items() if s in rates}}
        rows = [{"system": s, "human": human_rates[s], "simulated": rates[s]} for s in human_rates if s in rates]
        try:
            result = correlate(rows, RankCorrelationConfig(x="simulated", y="human", n_bootstrap=n_bootstrap,
                                                           seed=seed))
            entry.update(spearman=result.spearman, n_systems=result.n, spearman_interval=spearman_over_pairs(
                humans, systems, labels, everywhere, n_bootstrap, seed))
        except UserError as exc:  # too few systems, or a constant column: say why there is no correlation
            entry.update(spearman=None, spearman_interval=None, n_systems=len(rows), why=str(exc))
        out["simulators"][name] = entry
    return out


def build_report(rows: list[dict[str, Any]], sims: dict[str, dict[PairKey, list[float]]], *, seed: int = 0,
                 n_bootstrap: int = 2000) -> dict[str, Any]:
    """The whole report as plain data (``alpacafarm label report --json`` prints it)."""
    humans = human_by_pair(rows)
    if not humans:
        raise UserError("the session has no human labels yet (skips are not labels): label some pairs first")
    all_labels = {k: [label for _, label in v] for k, v in humans.items()}
    overlap = {k: v for k, v in all_labels.items() if len(v) >= 2}
    human_human: dict[str, Any] | None = None
    if overlap:
        result = measure(label_records(overlap), AgreementConfig(seed=seed))
        human_human = {"agreement": result.humans["agreement"], "pairs": len(overlap),
                       "labels": result.humans["n_labels"], **light_kappa(humans),
                       **human_intervals(humans, seed, n_bootstrap),
                       "p_prefer_longer": result.humans["p_prefer_longer"]}  # on the same labels as the rest
    systems = {_key(r): (r["generator_1"], r["generator_2"]) for r in rows if r.get("generator_1")
               and r.get("generator_2")}
    return {
        "humans": {"labellers": sorted({r["labeller"] for r in rows}), "labels": sum(map(len, all_labels.values())),
                   "skipped": sum(r["preference"] is None for r in rows), "pairs": len(all_labels),
                   **preference_shares(all_labels, 0)},
        "human_human": human_human,
        "min_shared_pairs": MIN_SHARED_PAIRS,
        "warnings": [w for w in [shared_pairs_warning(len(overlap))] if w],
        "paper_human_agreement": PAPER_HUMAN_AGREEMENT,
        "simulators": {name: simulator_row(humans, labels, seed, n_bootstrap) for name, labels in sims.items()},
        "win_rates": correlation(humans, systems, sims, n_bootstrap, seed),
    }


def labels_from_file(path: Path) -> dict[PairKey, list[float]]:
    """A simulator's labels from an ``alpacafarm annotate`` output (or any records with instruction, output_1,
    output_2, preference), one or several per pair (replicates)."""
    from alpacafarm.data import read_records

    if not path.is_file():
        raise UserError(f"annotator labels file not found: {path}")
    return group(read_records(path), str(path), by_replicate=True).labels


def plot(report: dict[str, Any], path: Path) -> None:
    """Agreement with the humans per annotator (with the human-human figure and the paper's), and, given systems,
    human vs simulated win-rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["win_rates"]
    panels = 2 if rates and rates["humans"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    names = list(report["simulators"])
    values = [report["simulators"][n]["agreement"] * 100 for n in names]
    if report["human_human"]:
        names.append("human vs human")
        values.append(report["human_human"]["agreement"] * 100)
    colours = ["#4c72b0"] * len(report["simulators"]) + ["#55a868"] * (len(names) - len(report["simulators"]))
    ax.barh(names, values, color=colours)
    ax.axvline(PAPER_HUMAN_AGREEMENT * 100, color="grey", linestyle="--", label="paper: human vs human 65.7%")
    ax.set_xlim(0, 100)
    ax.set_xlabel("agreement with human labels (%)")
    ax.legend(loc="lower right", fontsize=8)
    if panels == 2:
        ax = axes[0][1]
        for marker, (name, entry) in zip("os^vDP*X", rates["simulators"].items(), strict=False):
            systems = [s for s in rates["humans"] if s in entry["win_rates"]]
            rho = entry.get("spearman")
            label = f"{name} (Spearman {rho:.2f})" if rho is not None else name
            ax.errorbar([entry["win_rates"][s] for s in systems], [rates["humans"][s] for s in systems],
                        xerr=[entry.get("win_rate_se", {}).get(s, 0.0) for s in systems],
                        yerr=[rates.get("humans_se", {}).get(s, 0.0) for s in systems],
                        fmt=marker, capsize=2, elinewidth=0.8, label=label)
            for s in systems:
                ax.annotate(s, (entry["win_rates"][s], rates["humans"][s]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.plot([0, 100], [0, 100], color="grey", linewidth=0.5)
        ax.set_xlabel("simulated win-rate (%), bars: ±1 standard error")
        ax.set_ylabel("human win-rate (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
