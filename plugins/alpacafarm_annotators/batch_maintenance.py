"""What ``alpacafarm annotate --batch-cancel`` and ``--batch-forget`` do to one prompted annotator's batches, on a
:class:`~alpacafarm_annotators.batch_call.BatchCall` without pairs.

- **cancel**: cancel the open batches at the provider, wait up to ``batch_wait_s`` for each to stop, book what
  it answered (paid), free the rest.
- **forget**: release the pairs of a pending batch the provider no longer knows (it answers 404 for the batch or
  for its output file): the record is closed as ``forgotten``, nothing is booked in the ledger (what the provider
  may have billed for it is unknown here) and the next run submits, and pays for, those pairs again. A batch the
  provider still knows is never forgotten: it can still be collected or cancelled, and forgetting it would pay
  for its pairs twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from alpacafarm.annotation_batches import BatchRecord
from alpacafarm.errors import UserError
from alpacafarm_annotators.batch_api import TERMINAL, BatchUnknown
from alpacafarm_annotators.batch_call import BatchCall


def _matching(call: BatchCall, which: str) -> list[BatchRecord]:
    """The annotator's open batches at its endpoint that ``which`` names (``all``, a local or a provider id)."""
    return [r for r in call.ledger.batches(annotator=call.judge.name)
            if r.endpoint == call.judge.endpoint and which in ("all", r.id, r.remote_id)]


async def cancel(call: BatchCall, which: str) -> list[dict[str, Any]]:
    """Cancel the annotator's open batches at its endpoint (``which``: ``all`` or a batch id), wait up to
    ``batch_wait_s`` for each to stop and book what it answered; one summary per batch."""
    config = call.config
    client = call.open_api()
    assert call.api is not None
    done = []
    try:
        for record in _matching(call, which):
            if record.state == "submitting":
                if not call.ledger.take_over(record, config.claim_stale_s):
                    continue  # its submitter is alive: cancel it once it is submitted
                await call._repair(record)
                record = call.ledger.get(record.id)
                if record is None or record.state != "pending":
                    done.append({"batch": record.label if record else "?", "state": "abandoned"})
                    continue
            try:
                batch = await call.api.cancel(record.remote_id)
                deadline = time.monotonic() + config.batch_wait_s
                delay = config.batch_poll_s
                while batch.status not in TERMINAL and time.monotonic() < deadline:
                    await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, config.batch_max_poll_s)
                    batch = await call.api.retrieve(record.remote_id)
                if batch.status in TERMINAL:
                    await call.collect(record, batch)
                else:
                    call.ledger.update_status(record.id, batch.status)
            except BatchUnknown as exc:  # nothing to cancel there: only forgetting it frees its pairs
                raise UserError(call._unknown(record, exc)) from None
            done.append({"batch": record.label, "annotator": record.annotator, "state": batch.status,
                         "pairs": record.n_pairs})
    finally:
        await client.close()
    return done


async def forget(call: BatchCall, which: str) -> list[dict[str, Any]]:
    """Release the pairs of the pending batch ``which`` (a local or a provider id) when, and only when, the provider
    answers 404 for it or for its output file (see the module); one summary per batch forgotten."""
    client = call.open_api()
    assert call.api is not None
    done = []
    try:
        for record in _matching(call, which):
            if record.state != "pending":  # not at the provider yet: a run repairs it (adopts or abandons it)
                raise UserError(f"batch {record.label} is still being submitted (by pid {record.pid} on "
                                f"{record.host}): it is not forgotten; re-run with mode: batch, which adopts or "
                                "abandons it")
            try:
                batch = await call.api.retrieve(record.remote_id)
                if batch.status not in TERMINAL:
                    raise UserError(
                        f"the provider still knows batch {record.label} (status {batch.status}): it is not "
                        f"forgotten (its pairs would be paid twice); wait for it (re-run with mode: batch) or cancel "
                        f"it with alpacafarm annotate --annotator {record.annotator} --batch-cancel {record.label}")
                await call.api.results(batch)
            except BatchUnknown as exc:
                reason = exc.detail
            else:
                raise UserError(f"the provider still has batch {record.label} and its answers ({batch.status}): it "
                                "is not forgotten; re-run with mode: batch to collect it")
            if call.ledger.forget(record.id, f"forgotten: the provider no longer knows it ({reason})"):
                done.append({"batch": record.label, "annotator": record.annotator, "state": "forgotten",
                             "pairs": record.n_pairs, "reason": reason, "booked_usd": 0.0,
                             "max_cost_usd": record.max_cost_usd})
    finally:
        await client.close()
    return done
