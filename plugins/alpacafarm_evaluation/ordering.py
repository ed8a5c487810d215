"""``alpacafarm ordering``: does a run order the methods as the paper does?

The paper's finding is an ordering of methods by their gain over the SFT model (Table 2, simulated column, against
SFT 10k: PPO +10.1, DPO +10.1, best-of-1024 +8.3, expert iteration +5.2, binary FeedME -0.1, Quark -1.1, binary
reward conditioning -4.3). A run's ordering is its systems' gains over its base system (the SFT row), from the
finished evaluation's judged pairs. The command matches the run's systems to the reference's methods, and prints
for the methods both have:

- Spearman's rho and Kendall's tau-b between the run's gains and the reference's;
- a percentile bootstrap interval of each, resampling the *instructions* (the run's uncertainty: the reference's
  figures are taken as fixed), with every system rescored on the same resample, as paired statistics need;
- the pairs of methods whose order swaps, with the run's paired difference ± SE and how often the bootstrap swaps
  them.

Names are matched after dropping ``_outputs`` and comparing letters and digits only (``expert_iteration_outputs`` is
``Expert Iteration``); ``best_of_<n>`` (the largest n the run has) is ``Best-of-1024``; ``--map ours=paper`` names
any other pairing, and ``--base`` the run's system that stands for ``SFT 10k`` (default: the table's first).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from alpacafarm.errors import UserError

#: The paper's base system: every reference gain is a win-rate minus this row's.
PAPER_BASE = "SFT 10k"
#: The reference's best-of-n row, matched by the run's largest n.
PAPER_BEST_OF = "Best-of-1024"
#: Below this many common methods no rank correlation is printed.
MIN_METHODS = 3


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", re.sub(r"_outputs$", "", name.lower()))


@dataclass
class Ordering:
    """What the command prints (``--json``): matched methods with both gains, the correlations with their
    intervals, and the swapped pairs."""

    base: str
    reference_base: str
    n_instructions: int
    methods: list[dict[str, Any]]
    spearman: float | None
    spearman_interval: list[float] | None
    kendall: float | None
    kendall_interval: list[float] | None
    swaps: list[dict[str, Any]] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    n_bootstrap: int = 0
    seed: int = 0


def read_reference(path: Path, column: str = "simulated") -> dict[str, float]:
    """Each method's gain over :data:`PAPER_BASE` in points, from a table with ``system`` and ``column``."""
    from alpacafarm.paths import read_text

    rows = list(csv.DictReader(read_text(path, "reference table").splitlines()))
    if not rows or "system" not in rows[0] or column not in rows[0]:
        raise UserError(f"reference table {path}: needs the columns 'system' and {column!r}")
    values: dict[str, float] = {}
    for i, row in enumerate(rows, start=2):
        cell = (row.get(column) or "").strip()
        if not cell:
            continue
        try:
            value = float(cell)
        except ValueError:
            raise UserError(f"reference table {path}: line {i}, {column} {cell!r} is not a number") from None
        if not math.isfinite(value):
            raise UserError(f"reference table {path}: line {i}, {column} {cell!r} is not finite")
        values[row["system"].strip()] = value
    if PAPER_BASE not in values:
        raise UserError(f"reference table {path}: no {PAPER_BASE!r} row to take gains against")
    return {name: round(value - values[PAPER_BASE], 6) for name, value in values.items() if name != PAPER_BASE}


def match(systems: list[str], reference: dict[str, float], mapping: dict[str, str]) -> dict[str, str]:
    """Which run system stands for which reference method (``mapping`` first, then names; see the module)."""
    matched: dict[str, str] = {}
    for ours, theirs in mapping.items():
        if ours not in systems:
            raise UserError(f"--map {ours}={theirs}: the run has no system {ours!r} (it has: {', '.join(systems)})")
        if theirs not in reference:
            raise UserError(f"--map {ours}={theirs}: the reference has no method {theirs!r} "
                            f"(it has: {', '.join(reference)})")
        matched[ours] = theirs
    by_name = {_normal(name): name for name in reference}
    best_of = [(int(m.group(1)), s) for s in systems if (m := re.fullmatch(r"best_of_(\d+)", s))]
    for system in systems:
        if system in matched or system in mapping.values():
            continue
        if best_of and system == max(best_of)[1] and PAPER_BEST_OF in reference:
            theirs = PAPER_BEST_OF
        else:
            theirs = by_name.get(_normal(system))
        if theirs is not None and theirs not in matched.values():
            matched[system] = theirs
    return matched


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks along the last axis, ties sharing their average rank."""
    order = values.argsort(axis=-1, kind="stable")
    ranks = np.empty_like(values, dtype=float)
    np.put_along_axis(ranks, order, np.arange(values.shape[-1], dtype=float) * np.ones_like(values), axis=-1)
    for index in np.ndindex(values.shape[:-1]):  # average tied ranks (few methods: a loop is cheap)
        row, rank = values[index], ranks[index]
        for value in np.unique(row):
            tied = row == value
            if tied.sum() > 1:
                rank[tied] = rank[tied].mean()
    return ranks


def spearman(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row of ``ours`` against ``theirs`` (NaN where a row's ranks do not vary)."""
    a, b = _ranks(ours), _ranks(theirs[None, :])[0]
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean()
    denominator = np.sqrt((a * a).sum(axis=-1) * (b * b).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (a * b).sum(axis=-1) / denominator, np.nan)


def kendall(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Kendall's tau-b of each row of ``ours`` against ``theirs`` (ties in either counted as tau-b does)."""
    i, j = np.triu_indices(theirs.shape[0], k=1)
    x = np.sign(ours[..., i] - ours[..., j])
    y = np.sign(theirs[i] - theirs[j])
    concordance = (x * y).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return concordance / np.sqrt((x != 0).sum(axis=-1) * (y != 0).sum())


def ordering(scores: dict[str, dict[str, float]], base: str, matched: dict[str, str], reference: dict[str, float],
             n_bootstrap: int = 2000, seed: int = 0) -> Ordering:
    """The run's ordering against the reference (see the module). ``scores``: per system, per instruction key, its
    score (1 win, 0.5 tie, 0 loss, or a weighted preference); only instructions every compared system has count."""
    methods = [s for s in matched if s != base]
    keys = sorted(set.intersection(*(set(scores[s]) for s in [base, *methods]))) if methods else []
    if not keys:
        raise UserError(f"ordering: no instruction is judged for {base!r} and every matched system")
    base_scores = np.array([scores[base][k] for k in keys])
    diffs = np.array([[scores[s][k] for k in keys] for s in methods]) - base_scores  # [methods, instructions]
    gains = 100 * diffs.mean(axis=1)
    paper = np.array([reference[matched[s]] for s in methods])
    rows = [{"system": s, "method": matched[s], "gain": float(g),
             "paired_se": float(100 * diffs[i].std(ddof=1) / math.sqrt(len(keys))) if len(keys) > 1 else None,
             "reference_gain": float(paper[i])} for i, (s, g) in enumerate(zip(methods, gains, strict=True))]
    result = Ordering(base, PAPER_BASE, len(keys), rows, None, None, None, None, n_bootstrap=n_bootstrap, seed=seed)
    if len(methods) < MIN_METHODS:
        return result
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(keys), size=(n_bootstrap, len(keys)))
    boot = 100 * diffs[:, draws].mean(axis=2).T  # [bootstrap, methods]
    for name, function in (("spearman", spearman), ("kendall", kendall)):
        point = float(function(gains[None, :], paper)[0])
        samples = function(boot, paper)
        samples = samples[np.isfinite(samples)]
        setattr(result, name, None if math.isnan(point) else round(point, 4))
        setattr(result, f"{name}_interval", [round(float(np.percentile(samples, q)), 4) for q in (2.5, 97.5)]
                if samples.size else None)
    for i in range(len(methods)):
        for j in range(len(methods)):
            if paper[i] > paper[j] and gains[i] < gains[j]:  # the reference puts i above j; the run below
                difference = diffs[j] - diffs[i]
                result.swaps.append({
                    "above_in_reference": methods[i], "below_in_reference": methods[j],
                    "run_difference": round(float(100 * difference.mean()), 4),
                    "paired_se": round(float(100 * difference.std(ddof=1) / math.sqrt(len(keys))), 4),
                    "bootstrap_share_swapped": round(float((boot[:, i] < boot[:, j]).mean()), 4)})
    return result


def evaluation_scores(run_dir: Path, stage: str) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per system (in the evaluation's order), per instruction, its score, from a finished evaluation stage."""
    from alpacafarm.artifacts import Artifact
    from alpacafarm_evaluation.bench import judged_records
    from alpacafarm_evaluation.bench_baseline import outcomes_of

    manifest_path = run_dir / "stages" / stage / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"ordering: {manifest_path} does not exist (is {run_dir} a run folder, and {stage!r} its "
                        "evaluation stage? --stage names another)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"ordering: cannot read {manifest_path}: {exc}") from None
    if manifest.get("status") != "complete" or "artifact" not in manifest:
        raise UserError(f"ordering: stage {stage!r} of {run_dir} did not finish (status "
                        f"{manifest.get('status')!r}): run the recipe to the end first")
    records = judged_records(Artifact.from_json(manifest["artifact"], run_dir))
    return {name: outcomes_of(name, rows).scores for name, rows in records.items()}, list(records)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alpacafarm ordering", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run folder whose evaluation finished")
    parser.add_argument("--stage", default="evaluate", help="its evaluation stage (default: evaluate)")
    parser.add_argument("--reference", default="paper",
                        help="'paper' (Table 2, shipped: alpacafarm/bundled_data/SOURCES.md) or a CSV with system, "
                             "the column and an 'SFT 10k' row")
    parser.add_argument("--column", default="simulated", help="the reference's column (default: simulated)")
    parser.add_argument("--base", help="the run's system standing for SFT 10k (default: the evaluation's first)")
    parser.add_argument("--map", action="append", default=[], metavar="OURS=PAPER",
                        help="pair a run system with a reference method by hand (repeatable)")
    parser.add_argument("--n-bootstrap", type=int, default=2000, help="bootstrap resamples of the instructions")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    from alpacafarm.console import print_table
    from alpacafarm.data import PAPER_TABLE2

    args = parse_args(argv)
    if args.n_bootstrap < 1:
        raise UserError(f"--n-bootstrap {args.n_bootstrap}: must be at least 1")
    mapping: dict[str, str] = {}
    for item in args.map:
        ours, sep, theirs = item.partition("=")
        if not sep or not ours.strip() or not theirs.strip():
            raise UserError(f"--map {item!r}: expected OURS=PAPER, e.g. ppo_outputs=PPO")
        mapping[ours.strip()] = theirs.strip()
    reference = read_reference(PAPER_TABLE2 if args.reference == "paper" else Path(args.reference), args.column)
    scores, systems = evaluation_scores(Path(args.run_dir), args.stage)
    base = args.base or systems[0]
    if base not in scores:
        raise UserError(f"--base {base!r}: the evaluation has no such system (it has: {', '.join(systems)})")
    matched = match([s for s in systems if s != base], reference, mapping)
    result = ordering(scores, base, matched, reference, args.n_bootstrap, args.seed)
    result.unmatched = [s for s in systems if s != base and s not in matched]
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return 0

    def interval(values: list[float] | None) -> str:
        return "-" if values is None else f"[{values[0]:+.2f}, {values[1]:+.2f}]"

    ranked = sorted(result.methods, key=lambda m: -m["reference_gain"])
    print_table(f"gain over {base} (run) and over {PAPER_BASE} (reference), points of win-rate",
                ["method", "system", "run gain ± paired SE", "reference gain"],
                [[m["method"], m["system"], f"{m['gain']:+.1f} ± {m['paired_se'] or 0:.1f}",
                  f"{m['reference_gain']:+.1f}"] for m in ranked])
    if result.spearman is None and result.kendall is None:
        print(f"fewer than {MIN_METHODS} matched methods: no rank correlation")
    else:
        print(f"Spearman {result.spearman:+.2f} {interval(result.spearman_interval)}, Kendall tau-b "
              f"{result.kendall:+.2f} {interval(result.kendall_interval)} (95% bootstrap over "
              f"{result.n_instructions} instructions, {result.n_bootstrap} resamples)")
    for swap in result.swaps:
        print(f"swapped: the reference puts {swap['above_in_reference']} above {swap['below_in_reference']}; the run "
              f"puts it {swap['run_difference']:.1f} ± {swap['paired_se']:.1f} points below "
              f"(swapped in {100 * swap['bootstrap_share_swapped']:.0f}% of the bootstrap)")
    if result.unmatched:
        print(f"not in the reference: {', '.join(result.unmatched)} (--map OURS=PAPER pairs one by hand)")
    return 0
