"""``alpacafarm annotate INPUT --annotator NAME -o OUTPUT``: label pairs of outputs with any registered annotator."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import yaml

from alpacafarm.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alpacafarm annotate", description=__doc__)
    parser.add_argument("input", help="JSON or JSONL records with instruction, optional input, output_1, output_2")
    parser.add_argument("--annotator", required=True, help="a registered annotator (see: alpacafarm plugins)")
    parser.add_argument("-o", "--output", required=True, help="output JSON file (records + preference and costs)")
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint for API annotators")
    parser.add_argument("--model-map", action="append", default=[], metavar="OLD=NEW",
                        help="send model OLD as NEW (e.g. gpt-4-0314=gpt-4.1); repeatable")
    parser.add_argument("--max-cost-usd", type=float, help="stop before spending more than this")
    parser.add_argument("--seed", type=int, help="pool seed (assignment, order, noise)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the annotation cache")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="any annotator config field, e.g. --set max_concurrency=4 (pools: applied to members)")
    return parser.parse_args(argv)


def _overrides(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    member: dict[str, Any] = {}
    if args.base_url:
        member["base_url"] = args.base_url
    if args.model_map:
        pairs = [m.split("=", 1) for m in args.model_map]
        if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
            raise UserError(f"--model-map expects OLD=NEW, got {args.model_map}")
        member["model_map"] = dict(pairs)
    if args.max_cost_usd is not None:
        member["max_cost_usd"] = args.max_cost_usd
    if args.no_cache:
        member["cache"] = False
    for setting in args.settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KEY=VALUE, got {setting!r}")
        member[key] = yaml.safe_load(raw)
    if kind == "pool":
        out: dict[str, Any] = {"overrides": member} if member else {}
        if args.seed is not None:
            out["seed"] = args.seed
        return out
    if args.seed is not None:
        raise UserError(f"--seed applies to pools; {args.annotator!r} is a single annotator")
    return member


def build_annotator(name: str, args: argparse.Namespace) -> Any:
    from alpacafarm.plugins import get_registry
    from alpacafarm_annotators.presets import AnnotatorFactory

    factory = get_registry().get("annotator", name)
    if isinstance(factory, AnnotatorFactory):
        return factory(_overrides(args, factory.kind))
    if args.base_url or args.model_map or args.max_cost_usd is not None or args.seed is not None:
        raise UserError(f"annotator {name!r} takes no --base-url/--model-map/--max-cost-usd/--seed")
    settings = _overrides(argparse.Namespace(**{**vars(args), "no_cache": False}), "prompted")
    config_class = getattr(factory, "config_class", None)
    return factory(config_class.model_validate(settings) if config_class else settings)


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
    annotator = build_annotator(args.annotator, args)

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
