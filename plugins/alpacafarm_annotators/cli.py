"""``alpacafarm annotate INPUT --annotator NAME -o OUTPUT``: label pairs of outputs with any registered annotator.

Variance: ``--replicates K`` writes K independent annotations per pair (records in input order, each repeated K
times with ``replicate`` 0..K-1). Replicate 0 is the ordinary annotation (the same cache entries and seeded
draws as a run without the flag); replicate k > 0 is a fresh draw of everything random (a pool's member, order
and label noise; an API judge's sampling), cached under its own key, so it is paid for once and a later run
with more replicates pays only for the new ones. A deterministic judge (``offline``, ``local_judge``, a greedy
API judge) gives the same label to every replicate: its variance is 0. ``alpacafarm compare HUMAN.json
--agreement --annotator-labels OUTPUT`` then reports the annotator's variance (each replicate against the
majority of the others; the paper's variance uses 4 annotations per pair: ``--replicates 4``). An input record
that repeats a pair gets the same annotation as its first occurrence (it is the same annotation, cached).

Every output record has an ``outcome``: ``labelled``, ``tie``, ``unparsed`` (the judge's own answer could not be
read, even asked again and alone; with ``error``) or ``failed`` (no answer: endpoint down, HTTP errors, garbage;
with ``error``; never cached, asked again by the next run). The last line of stdout is a JSON summary: counts of
each outcome, the endpoint (base URL, never the key), the first error, and this run's ledger (requests, tokens,
dollars actually paid). Exit status: 0 when every pair got an answer (labelled, tie or unparsed), 1 when pairs
failed (one line on stderr names the endpoint and the first error; what succeeded is written and cached, so a
re-run pays only for the failed pairs), 2 for a mistake in the command (file, annotator, option), 75 when pairs
are in batches still pending (``mode: batch``: "batch pending, re-run to collect"; nothing is written yet).

Batches: ``--batch-status`` lists the pending batches recorded in the annotation cache (their age and worst-case
cost); ``--annotator NAME --batch-cancel [BATCH]`` cancels that annotator's pending batches (all, or one) and
books what they had answered; ``--annotator NAME --batch-forget BATCH`` releases the pairs of a pending batch its
provider no longer knows (404), booking nothing, so that a later run can submit them again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from alpacafarm.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    from alpacafarm.annotation import add_annotator_options

    parser = argparse.ArgumentParser(prog="alpacafarm annotate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", help="JSON or JSONL records with instruction, optional input, output_1, "
                        "output_2")
    parser.add_argument("--annotator", help="a registered annotator (see: alpacafarm plugins), or "
                        "alpaca_eval:<config> for one of AlpacaEval's evaluator configs (extra: alpaca-eval)")
    parser.add_argument("-o", "--output", help="output JSON file (records + preference and costs)")
    parser.add_argument("--describe", action="store_true", help="print the resolved annotator (members, models, "
                        "where each template comes from, parsers, decoding) and exit; needs no input")
    parser.add_argument("--replicates", type=int, default=1, metavar="K",
                        help="independent annotations per pair (default 1), to measure the annotator's variance")
    batches = parser.add_argument_group("batches (mode: batch)")
    batches.add_argument("--batch-status", action="store_true", help="list the pending batches in the annotation "
                         "cache (annotator, endpoint, status, age, pairs, worst-case cost) and exit; sends nothing")
    batches.add_argument("--batch-cancel", nargs="?", const="all", metavar="BATCH", help="cancel the annotator's "
                         "pending batches (or only BATCH), book what they answered, and exit")
    batches.add_argument("--batch-forget", metavar="BATCH", help="release the pairs of the pending batch BATCH "
                         "that its provider no longer knows (it answers 404 for the batch or its output file): "
                         "nothing is booked in the ledger, and the next run submits (and pays for) them again; a "
                         "batch the provider still knows is refused")
    add_annotator_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    from alpacafarm.annotation import AnnotationFailed, summarize
    from alpacafarm.console import console, print_table
    from alpacafarm.data import read_records, write_json
    from alpacafarm.paths import check_output_file
    from alpacafarm.types import Pair

    args = parse_args(argv)
    if args.batch_status:
        from alpacafarm_annotators.batch_cli import batch_status

        return batch_status(args)
    if args.annotator is None:
        raise UserError("annotate needs --annotator NAME (see: alpacafarm plugins)")
    if args.batch_cancel is not None:
        from alpacafarm_annotators.batch_cli import batch_cancel

        return batch_cancel(args)
    if args.batch_forget is not None:
        from alpacafarm_annotators.batch_cli import batch_forget

        return batch_forget(args)
    if args.describe:
        return describe(args)
    if args.input is None or args.output is None:
        raise UserError("annotate needs an INPUT file and -o OUTPUT (or --describe)")
    if args.replicates < 1:
        raise UserError(f"--replicates must be >= 1, got {args.replicates}")
    path = Path(args.input)
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    check_output_file(args.output, "-o")  # before any annotation is paid for
    records = read_records(path)
    try:
        pairs = [Pair.from_record(r) for r in records]
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    repeated = len(pairs) - len({(p.instruction, p.input, p.output_1, p.output_2) for p in pairs})
    if repeated:
        console().print(f"note: {repeated} record(s) repeat a pair of an earlier record and get its annotation; "
                        "use --replicates K for independent annotations of the same pair")
    from alpacafarm.annotation import annotator_from_options
    from alpacafarm.plugins import get_registry

    annotator = annotator_from_options(get_registry(), args.annotator, args)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.perf_counter()
    spent = [0.0]
    by_replicate = []
    with Progress(TextColumn("annotating"), BarColumn(), MofNCompleteColumn(), TextColumn("${task.fields[cost]:.4f}"),
                  TimeElapsedColumn(), console=console()) as progress:
        task = progress.add_task("annotate", total=len(pairs) * args.replicates, cost=0.0)

        def advance(n: int, cost: float) -> None:
            spent[0] += cost
            progress.update(task, advance=n, cost=spent[0])

        stopped: UserError | None = None
        for replicate in range(args.replicates):
            try:
                by_replicate.append(annotator.annotate(pairs, advance, replicate=replicate))
            except UserError as exc:  # a stop (budget, a full cache): write what was paid for, then report it
                partial = getattr(exc, "partial", None)
                if partial is None or len(partial) != len(pairs):
                    raise
                by_replicate.append(partial)
                stopped = exc
                break
    seconds = time.perf_counter() - started

    out = []
    annotations = []
    for i, record in enumerate(records):
        for replicate, replicate_annotations in enumerate(by_replicate):
            annotation = replicate_annotations[i]
            annotations.append(annotation)
            row = annotation.to_json()
            metadata = row.pop("metadata")
            if not annotation.has_label and metadata.get("error"):
                row["error"] = metadata["error"]
            out.append({**record, **row, "replicate": replicate})
    write_json(Path(args.output), out)
    summary = summarize(annotations)
    usage = annotator.usage()
    endpoint = summary.endpoint or getattr(annotator, "endpoint", None)
    parsed = summary.counts["labelled"] + summary.counts["tie"]
    print_table(f"{args.annotator}: {args.output}",
                ["n", "labelled", "ties", "unparsed", "failed", "cached", "noise", "requests", "USD", "time"],
                [[len(annotations), summary.counts["labelled"], summary.counts["tie"], summary.unparsed,
                  summary.failed, sum(a.cached for a in annotations), sum(a.noise for a in annotations),
                  usage.requests, f"{usage.price_usd:.4f}", f"{seconds:.1f}s"]])
    print(json.dumps({"n": len(annotations), "pairs": len(pairs), "replicates": args.replicates, "parsed": parsed,
                      "ties": summary.counts["tie"], "unparsed": summary.unparsed, "failed": summary.failed,
                      "endpoint": endpoint, "first_error": summary.first_error, **usage.to_json(),
                      "seconds": round(seconds, 2)}))
    if stopped is not None:
        raise stopped
    if summary.failed:
        where = f" at {endpoint}" if endpoint else ""
        raise AnnotationFailed(
            f"{summary.failed} of {len(annotations)} annotations failed ({args.annotator}{where}): first error: "
            f"{summary.first_error}; what succeeded is in {args.output} and cached: re-run to ask only for the "
            "failed pairs")
    return 0


def describe(args: argparse.Namespace) -> int:
    """``--describe``: the annotator as built from these options, without annotating (nothing is sent)."""
    from alpacafarm.annotation import annotator_from_options
    from alpacafarm.plugins import get_registry

    annotator = annotator_from_options(get_registry(), args.annotator, args)
    info = annotator.describe() if hasattr(annotator, "describe") else {"name": annotator.name,
                                                                         "kind": type(annotator).__name__}
    members = info.pop("members", None)
    for key, value in info.items():
        print(f"{key}: {value}")
    for i, member in enumerate(members or [], start=1):
        print(f"member {i}/{len(members)}: {member.pop('name')}")
        for key, value in member.items():
            print(f"  {key}: {json.dumps(value) if isinstance(value, dict | list) else value}")
    annotator.close()
    return 0
