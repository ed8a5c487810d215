"""``alpacafarm compare``: validate the simulator against human data.

Two modes:

``alpacafarm compare TABLE.csv --x COL --y COL [--name-column system] [--filter COL=VALUE] [--json] [--plot OUT.png]``
    Rank correlation of two win-rate columns over systems (the paper's Figure 3). TABLE is a .csv, .json or .jsonl
    file with one row per system. TABLE may be ``paper`` for the paper's Table 2 shipped with this plugin
    (columns system, simulated, simulated_se, human, human_se, trained_by_authors). With ``--json`` it prints one
    object: spearman, pearson, kendall, r2, slope, intercept, n, n_skipped, skipped, intervals {metric: [lo, hi]},
    n_bootstrap_used, mismatches [{name, rank_x, rank_y, x, y}].

``alpacafarm compare --agreement HUMAN.json [--annotator-labels SIM.json] [--reference held_out|all] [--json]``
(equivalently ``alpacafarm compare HUMAN.json --agreement ...``, the form to use while the core CLI cannot pass an
option as a plugin command's first argument; ``alpacafarm compare -- --agreement HUMAN.json`` works too)
    Agreement, bias, variance, P(prefer longer), P(prefer first) of the humans (leave-one-out) and of an
    annotator's labels on the same pairs. Both files hold records with instruction, output_1, output_2,
    preference (1, 2, 0 = tie, null = no label); HUMAN has several records per pair (e.g. 4 humans, an
    annotator_index field is allowed and ignored); SIM has one or several labels per pair and is matched on
    (instruction, output_1, output_2); unmatched pairs are counted. With ``--json`` it prints one object:
    {reference, seed, counts {pairs, human_labels, human_missing, pairs_single_label, annotator_labels,
    annotator_missing, annotator_pairs_matched, annotator_pairs_unmatched, human_pairs_unlabelled},
    humans {agreement, bias, variance, p_prefer_longer, n_length_decided, p_prefer_first, n_labels},
    annotator {same keys} or null}; all rates are fractions in [0, 1]. See alpacafarm_validation.agreement for
    the exact definitions.

    Annotator variance needs several independent annotations per pair by the same annotator. Annotating a pair
    twice gives the same label (cache and seeded draws), so ask for replicates:
        alpacafarm annotate pairs.json --annotator alpacafarm_ann --replicates 4 -o SIM.json
    (one record per pair in pairs.json; SIM.json gets 4, with replicate 0-3). The annotator's variance is then
    each label against the majority of its other labels of the pair: with 4, against the majority of 3, the
    paper's definition (p_sim^ann 0.43, p_sim^eval 0.26, humans 0.35, greedy GPT-4 0.1); with 2, the rate at
    which two annotations disagree. Records with equal pair and replicate are copies of one annotation: one is
    kept (counts.annotator_repeats). A deterministic annotator (offline, a greedy judge) has variance 0.

``alpacafarm compare --variance SIM.json [--json]`` (or ``compare SIM.json --variance``)
    The variance of an annotator from its replicate labels alone, without human labels: {variance, p_prefer_longer,
    n_length_decided, p_prefer_first, n_labels, pairs (with >= 2 labels), labels_per_pair, pairs_single_label,
    missing, repeats}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.paths import check_output_file, user_path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alpacafarm compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", nargs="?", help="table of systems (.csv/.json/.jsonl), or 'paper' for Table 2")
    parser.add_argument("--x", help="column on the x-axis (e.g. simulated)")
    parser.add_argument("--y", help="column on the y-axis (e.g. human)")
    parser.add_argument("--name-column", help="column with system names (default: 'system', else the first)")
    parser.add_argument("--filter", action="append", default=[], metavar="COL=VALUE",
                        help="keep only rows where COL equals VALUE (e.g. trained_by_authors=1); repeatable")
    parser.add_argument("--plot", metavar="OUT.png", help="write a Figure-3-style scatter plot")
    parser.add_argument("--n-bootstrap", type=int, default=2000, help="bootstrap resamples (0: no intervals)")
    parser.add_argument("--agreement", nargs="?", const=True, metavar="HUMAN.json",
                        help="multiply-annotated human preferences; without a value, TABLE is that file")
    parser.add_argument("--annotator-labels", metavar="SIM.json",
                        help="an annotator's labels on the same pairs; several per pair (annotate --replicates K) "
                             "give its variance")
    parser.add_argument("--variance", nargs="?", const=True, metavar="SIM.json",
                        help="an annotator's variance from its replicate labels alone (annotate --replicates K, "
                             "K >= 2; 4 as in the paper); without a value, TABLE is that file")
    parser.add_argument("--reference", choices=["held_out", "all"], default="held_out",
                        help="annotator vs majority of n-1 humans (paper, default) or of all n (AlpacaEval)")
    parser.add_argument("--length-margin", type=int, default=0,
                        help="P(prefer longer) skips pairs whose lengths differ by <= this many characters")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap or of the tie-breaks")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser.parse_args(argv)


def _records(path_text: str, what: str) -> list[dict[str, Any]]:
    from alpacafarm.data import read_records

    path = Path(path_text)
    if path.is_dir():
        raise UserError(f"{what} file {path} is a directory; give a file")
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}")
    records = read_records(path)
    if not records:
        raise UserError(f"{path}: no records")
    return records


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cmd_correlation(args: argparse.Namespace) -> int:
    from alpacafarm.plugins import get_registry
    from alpacafarm_validation.correlations import PAPER_TABLE2, plot

    if not args.x or not args.y:
        raise UserError("compare TABLE needs --x COLUMN and --y COLUMN (or use --agreement HUMAN.json)")
    filters: dict[str, str] = {}
    for item in args.filter:
        column, sep, value = item.partition("=")
        if not sep or not column:
            raise UserError(f"--filter expects COLUMN=VALUE, got {item!r}")
        filters[column.strip()] = value.strip()
    if args.n_bootstrap < 0:
        raise UserError(f"--n-bootstrap must be >= 0, got {args.n_bootstrap}")
    table = str(PAPER_TABLE2) if args.table == "paper" else args.table
    if args.plot:  # before the work: a plot path that cannot be written fails now, naming it
        check_output_file(args.plot, "--plot file")
    validator = get_registry().create("validator", "rank_correlation", {
        "x": args.x, "y": args.y, "n_bootstrap": args.n_bootstrap, "seed": args.seed,
        "name_column": args.name_column, "filters": filters})
    try:
        result = validator.validate(_records(table, "table"))
    except UserError as exc:  # name the table, once
        raise UserError(str(exc) if table in str(exc) else f"{table}: {exc}") from None
    if args.plot:
        with user_path(args.plot, "write"):
            plot(result, Path(args.plot))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0

    from alpacafarm.console import console, print_table

    rows = [[m, _fmt(getattr(result, m)), *(_fmt(v) for v in result.intervals.get(m, [None, None]))]
            for m in ("spearman", "pearson", "kendall", "r2", "slope")]
    rows.append(["intercept", _fmt(result.intercept), "", ""])
    title = f"{Path(table).name}: {args.y} vs {args.x} (n = {result.n}, skipped {result.n_skipped})"
    print_table(title, ["metric", "value", "95% lo", "95% hi"], rows)
    if result.mismatches:
        print_table("rank mismatches", ["system", f"rank by {args.x}", f"rank by {args.y}", args.x, args.y],
                    [[m["name"], m["rank_x"], m["rank_y"], m["x"], m["y"]] for m in result.mismatches])
    if args.plot:
        console().print(f"plot: {args.plot}")
    return 0


def cmd_agreement(args: argparse.Namespace) -> int:
    from alpacafarm.plugins import get_registry

    if args.table or args.x or args.y:
        raise UserError("--agreement takes no TABLE/--x/--y; give the human annotations file only")
    validator = get_registry().create("validator", "agreement", {
        "seed": args.seed, "reference": args.reference, "length_margin": max(args.length_margin, 0)})
    humans = _records(args.agreement, "human annotations")
    labels = _records(args.annotator_labels, "annotator labels") if args.annotator_labels else None
    result = validator.validate(humans, labels, human_source=args.agreement,
                                annotator_source=args.annotator_labels or "annotator")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0

    from alpacafarm.console import console, print_table

    keys = ("agreement", "bias", "variance", "p_prefer_longer", "p_prefer_first", "n_labels")
    rows = [["humans", *(_fmt(result.humans[k]) if k != "n_labels" else result.humans[k] for k in keys)]]
    if result.annotator is not None:
        rows.append([Path(args.annotator_labels).name,
                     *(_fmt(result.annotator[k]) if k != "n_labels" else result.annotator[k] for k in keys)])
    print_table(f"agreement with humans ({args.reference} reference, seed {args.seed})",
                ["annotator", "agreement", "bias", "variance", "P(longer)", "P(first)", "labels"], rows)
    console().print("counts: " + ", ".join(f"{k} {v}" for k, v in result.counts.items()))
    return 0


def cmd_variance(args: argparse.Namespace) -> int:
    from alpacafarm.plugins import get_registry

    if args.table or args.x or args.y or args.agreement or args.annotator_labels:
        raise UserError("--variance takes the annotator's labels file only (for agreement with humans too, use "
                        "--agreement HUMAN.json --annotator-labels SIM.json)")
    validator = get_registry().create("validator", "agreement", {
        "seed": args.seed, "length_margin": max(args.length_margin, 0)})
    result = validator.variance(_records(args.variance, "annotator labels"), source=args.variance)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    from alpacafarm.console import print_table

    print_table(f"{Path(args.variance).name}: variance over its replicates (seed {args.seed})",
                ["variance", "P(longer)", "P(first)", "labels", "pairs", "labels/pair", "single", "repeats"],
                [[_fmt(result["variance"]), _fmt(result["p_prefer_longer"]), _fmt(result["p_prefer_first"]),
                  result["n_labels"], result["pairs"], _fmt(result["labels_per_pair"], 2),
                  result["pairs_single_label"], result["repeats"]]])
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``alpacafarm compare``; UserError becomes one ``error:`` line and exit status 2."""
    args = parse_args(list(argv))
    if args.variance is True:  # ``compare SIM.json --variance``: the positional is the annotator's file
        if not args.table:
            raise UserError("--variance needs the annotator's labels file: --variance SIM.json")
        args.variance, args.table = args.table, None
    if args.variance:
        return cmd_variance(args)
    if args.agreement is True:  # ``compare HUMAN.json --agreement``: the positional is the human file
        if not args.table:
            raise UserError("--agreement needs the human annotations file: --agreement HUMAN.json")
        args.agreement, args.table = args.table, None
    if args.agreement:
        return cmd_agreement(args)
    if not args.table:
        raise UserError("compare needs a TABLE (with --x and --y) or --agreement HUMAN.json; see --help")
    return cmd_correlation(args)
