"""``alpacafarm annotate INPUT --annotator NAME -o OUTPUT``: label pairs of outputs with any registered annotator."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from alpacafarm.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    from alpacafarm.annotation import add_annotator_options

    parser = argparse.ArgumentParser(prog="alpacafarm annotate", description=__doc__)
    parser.add_argument("input", help="JSON or JSONL records with instruction, optional input, output_1, output_2")
    parser.add_argument("--annotator", required=True, help="a registered annotator (see: alpacafarm plugins)")
    parser.add_argument("-o", "--output", required=True, help="output JSON file (records + preference and costs)")
    add_annotator_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    from alpacafarm.console import console, print_table
    from alpacafarm.data import read_records, write_json
    from alpacafarm.types import Pair

    args = parse_args(argv)
    path = Path(args.input)
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    records = read_records(path)
    try:
        pairs = [Pair.from_record(r) for r in records]
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    from alpacafarm.annotation import annotator_from_options
    from alpacafarm.plugins import get_registry

    annotator = annotator_from_options(get_registry(), args.annotator, args)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.perf_counter()
    spent = [0.0]
    with Progress(TextColumn("annotating"), BarColumn(), MofNCompleteColumn(), TextColumn("${task.fields[cost]:.4f}"),
                  TimeElapsedColumn(), console=console()) as progress:
        task = progress.add_task("annotate", total=len(pairs), cost=0.0)

        def advance(n: int, cost: float) -> None:
            spent[0] += cost
            progress.update(task, advance=n, cost=spent[0])

        annotations = annotator.annotate(pairs, advance)
    seconds = time.perf_counter() - started

    out = []
    for record, annotation in zip(records, annotations, strict=True):
        row = annotation.to_json()
        row.pop("metadata")
        out.append({**record, **row})
    write_json(Path(args.output), out)
    parsed = sum(a.preference is not None for a in annotations)
    ties = sum(a.preference == 0 for a in annotations)
    cost = sum(a.price_usd for a in annotations if not a.cached)
    print_table(f"{args.annotator}: {args.output}", ["n", "parsed", "ties", "cached", "noise", "cost (USD)", "time"],
                [[len(pairs), parsed, ties, sum(a.cached for a in annotations), sum(a.noise for a in annotations),
                  f"{cost:.4f}", f"{seconds:.1f}s"]])
    print(json.dumps({"n": len(pairs), "parsed": parsed, "ties": ties, "cost_usd": round(cost, 6),
                      "seconds": round(seconds, 2)}))
    return 0
