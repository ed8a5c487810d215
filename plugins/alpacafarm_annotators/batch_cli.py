"""``alpacafarm annotate --batch-status``, ``--batch-cancel`` and ``--batch-forget``: the batches (``mode: batch``)
recorded in the annotation cache, listed without sending anything, cancelled at their endpoint, or, when their
provider no longer knows them, released. Batch ids are shown whole (they are ids, not keys): one can be copied
from ``--batch-status`` into ``--batch-cancel`` or ``--batch-forget``."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from alpacafarm.errors import UserError


def _age(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def batch_status(args: argparse.Namespace) -> int:
    """Print the open batches (a table, each batch's id in full with the commands that act on it, then one JSON
    line): nothing is sent, no key is needed."""
    from alpacafarm.annotation_batches import BatchLedger
    from alpacafarm.annotation_cache import AnnotationCache
    from alpacafarm.console import print_table

    cache = AnnotationCache()
    records = BatchLedger(cache).batches()
    now = time.time()
    print_table(f"pending batches in {cache.path}",
                ["batch", "annotator", "model", "endpoint", "status", "age", "pairs", "requests", "up to USD"],
                [[r.label, r.annotator, r.model, r.endpoint, r.remote_status or r.state, _age(now - r.created),
                  r.n_pairs, r.n_requests, f"{r.max_cost_usd:.4f}"] for r in records])
    for r in records:  # a table is cut to the terminal's width: the ids in full, one line each, to copy
        print(f"batch {r.label}: {r.annotator} at {r.endpoint}; cancel: alpacafarm annotate --annotator "
              f"{r.annotator} --batch-cancel {r.label}")
    print(json.dumps({"pending": len(records), "pairs": sum(r.n_pairs for r in records),
                      "max_cost_usd": round(sum(r.max_cost_usd for r in records), 6),
                      "batches": [r.to_json() for r in records]}))
    return 0


def _judges(annotator: Any) -> list[Any]:
    """The annotator's members that send batches (a pool's prompted members, or the annotator itself)."""
    found = [m for m in getattr(annotator, "members", [annotator]) if hasattr(m, "acancel_batches")]
    return list({id(m): m for m in found}.values())


def _each_judge(args: argparse.Namespace, act: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """``await act(judge)`` for every batch-sending member of ``--annotator``; their summaries, concatenated."""
    from alpacafarm.annotation import annotator_from_options
    from alpacafarm.plugins import get_registry

    annotator = annotator_from_options(get_registry(), args.annotator, args)
    judges = _judges(annotator)
    if not judges:
        raise UserError(f"annotator {args.annotator!r} sends no batches (it has no API judge)")

    async def each() -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        for judge in judges:
            done += await act(judge)
        return done

    try:
        return asyncio.run(each())
    finally:
        annotator.close()


def batch_cancel(args: argparse.Namespace) -> int:
    """Cancel the annotator's pending batches at its endpoint and book what they answered."""
    from alpacafarm.console import print_table

    done = _each_judge(args, lambda judge: judge.acancel_batches(args.batch_cancel))
    if not done and args.batch_cancel != "all":  # the id unquoted: a quoted random-looking word reads as a key
        raise UserError(f"no pending batch {args.batch_cancel} of annotator {args.annotator!r} at its endpoint "
                        "(alpacafarm annotate --batch-status lists them)")
    print_table(f"cancelled batches of {args.annotator}", ["batch", "annotator", "status", "pairs"],
                [[d.get("batch"), d.get("annotator", ""), d.get("state"), d.get("pairs", "")] for d in done])
    print(json.dumps({"cancelled": done}))
    return 0


def batch_forget(args: argparse.Namespace) -> int:
    """Release the pairs of a pending batch its provider no longer knows; say what that does to the ledger."""
    done = _each_judge(args, lambda judge: judge.aforget_batch(args.batch_forget))
    if not done:
        raise UserError(f"no pending batch {args.batch_forget} of annotator {args.annotator!r} at its endpoint "
                        "(alpacafarm annotate --batch-status lists them)")
    for d in done:
        print(f"forgot batch {d['batch']} ({d['reason']}): its {d['pairs']} pair(s) are free again; nothing is "
              f"booked in the ledger for it (it had reserved up to ${d['max_cost_usd']:.4f}; what the provider may "
              "have billed is unknown here); the next run submits those pairs, and pays for them, again")
    print(json.dumps({"forgotten": done}))
    return 0
