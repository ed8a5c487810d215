"""``alpacafarm annotate --batch-status`` and ``--batch-cancel``: the batches (``mode: batch``) recorded in the
annotation cache, listed without sending anything, or cancelled at their endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from alpacafarm.errors import UserError


def _age(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def batch_status(args: argparse.Namespace) -> int:
    """Print the open batches (a table, then one JSON line): nothing is sent, no key is needed."""
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
    print(json.dumps({"pending": len(records), "pairs": sum(r.n_pairs for r in records),
                      "max_cost_usd": round(sum(r.max_cost_usd for r in records), 6),
                      "batches": [r.to_json() for r in records]}))
    return 0


def _judges(annotator: Any) -> list[Any]:
    """The annotator's members that send batches (a pool's prompted members, or the annotator itself)."""
    found = [m for m in getattr(annotator, "members", [annotator]) if hasattr(m, "acancel_batches")]
    return list({id(m): m for m in found}.values())


def batch_cancel(args: argparse.Namespace) -> int:
    """Cancel the annotator's pending batches at its endpoint and book what they answered."""
    from alpacafarm.annotation import annotator_from_options
    from alpacafarm.console import print_table
    from alpacafarm.plugins import get_registry

    annotator = annotator_from_options(get_registry(), args.annotator, args)
    judges = _judges(annotator)
    if not judges:
        raise UserError(f"annotator {args.annotator!r} sends no batches (it has no API judge)")

    async def cancel_all() -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        for judge in judges:
            done += await judge.acancel_batches(args.batch_cancel)
        return done

    try:
        done = asyncio.run(cancel_all())
    finally:
        annotator.close()
    if not done and args.batch_cancel != "all":
        raise UserError(f"no pending batch {args.batch_cancel!r} of annotator {args.annotator!r} at its endpoint "
                        "(alpacafarm annotate --batch-status lists them)")
    print_table(f"cancelled batches of {args.annotator}", ["batch", "annotator", "status", "pairs"],
                [[d.get("batch"), d.get("annotator", ""), d.get("state"), d.get("pairs", "")] for d in done])
    print(json.dumps({"cancelled": done}))
    return 0
