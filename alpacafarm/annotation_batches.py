"""Batch submissions in the annotation cache: what was sent as a batch file, so that it is paid for exactly once
across processes, kills and days (``mode: batch`` of the prompted annotators).

A batch's life, each step one transaction in the cache's SQLite file (tables ``batches``, ``batch_requests``,
``batch_pairs``; see :mod:`alpacafarm.annotation_cache`):

1. **recorded** (:meth:`BatchLedger.open`, state ``submitting``) *before anything is uploaded*: its local id, the
   pairs it covers, each request's ``custom_id``, pair keys and body hash, its worst-case cost, and the process
   submitting it. The same transaction checks that the submitter still holds its claims on those pairs (no
   other process answered them or put them in a batch meanwhile) and turns the claims into the batch's: from
   here on no process claims them (:meth:`AnnotationCache.claim` reports them ``batched``), whatever happens to
   the submitter.
2. **submitted** (:meth:`BatchLedger.submitted`, state ``pending``): the provider's batch id. The batch is created
   with the local id in its ``metadata``, so a submitter killed between the provider's answer and this step is
   repaired by whoever finds the record next: the batch is looked up by that id and adopted, or, when the
   provider has none, the record is **abandoned** (nothing was bought) and its pairs are free again.
3. **collected** (:meth:`BatchLedger.collect`): its answers and their ledger rows, in the transaction that
   moves it out of ``pending`` (compare-and-set), so two processes polling the same batch book it once. Pairs
   the batch returned no answer for (expired, cancelled, failed lines) are free again and are re-submitted.
   Its ledger rows belong to the run that submitted it (its ``run``), whoever collects it: that run's summary
   and budget count it, never the collector's (:meth:`BatchLedger.booked` is what it cost).
4. **forgotten** (:meth:`BatchLedger.forget`, by ``alpacafarm annotate --batch-forget``): the provider no longer
   knows a pending batch (404 for it or its files), so it can never be collected: it is closed with nothing
   booked (what the provider may have billed for it is unknown here), and its pairs are free again.

A killed or closed run therefore resumes by polling the same batch and never submits its pairs again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alpacafarm.annotation_cache import (
    OPEN_BATCH_STATES,
    AnnotationCache,
    LedgerTotals,
    insert_request,
    open_batch_keys,
)
from alpacafarm.processes import HOST, claim_alive

COLUMNS = ("id", "remote_id", "annotator", "model", "endpoint", "state", "remote_status", "n_requests", "n_pairs",
           "max_cost_usd", "cost_usd", "input_file_id", "pid", "host", "run", "created", "submitted", "updated",
           "error")


@dataclass
class BatchRecord:
    """One row of ``batches``: a batch file sent (or about to be sent) for one annotator at one endpoint."""

    id: str
    remote_id: str | None
    annotator: str
    model: str
    endpoint: str
    state: str  # submitting, pending, collected, abandoned, forgotten
    remote_status: str | None  # the provider's: validating, in_progress, finalizing, completed, expired, ...
    n_requests: int
    n_pairs: int
    max_cost_usd: float  # the worst case reserved against the budget when it was submitted
    cost_usd: float | None  # what its answers cost, once collected
    input_file_id: str | None
    pid: int
    host: str
    run: str | None
    created: float
    submitted: float | None
    updated: float
    error: str | None

    @property
    def age_s(self) -> float:
        return time.time() - self.created

    @property
    def label(self) -> str:
        """The provider's id once known, else the local one."""
        return self.remote_id or self.id

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COLUMNS} | {"age_s": round(self.age_s, 1)}


@dataclass
class BatchRequest:
    """One line of a batch file: its ``custom_id``, the pair keys it asks about, the SHA-256 of its JSON body, and
    the upper bound of its prompt tokens (what its answer is booked at when the provider's usage is missing or
    not believable; None for records written before it was kept)."""

    custom_id: str
    keys: list[str]
    body_sha256: str
    tokens_in_bound: int | None = None


class BatchConflict(Exception):
    """:meth:`BatchLedger.open` found pairs that are no longer the submitter's (``lost``: key -> who has them)."""

    def __init__(self, lost: dict[str, str]) -> None:
        super().__init__(f"{len(lost)} pair(s) are no longer this process's to submit")
        self.lost = lost


class BatchLedger:
    """The batch tables of one :class:`~alpacafarm.annotation_cache.AnnotationCache`."""

    def __init__(self, cache: AnnotationCache) -> None:
        self.cache = cache

    # ---------------------------------------------------------------------------------------------- writing
    def open(self, batch_id: str, *, annotator: str, model: str, endpoint: str, requests: Sequence[BatchRequest],
             max_cost_usd: float, owner: str, run: str | None, stale_after_s: float) -> None:
        """Record a batch before it is uploaded (state ``submitting``), taking over ``owner``'s claims on its pairs.
        Raises :class:`BatchConflict` (recording nothing) when a pair is answered, in an open batch, or claimed
        by another live process."""
        keys = [key for request in requests for key in request.keys]
        now = time.time()
        with self.cache.errors("record a batch in"), self.cache.transaction() as db:
            lost = {}
            claimed: dict[str, str] = {}
            answered: set[str] = set()
            batched: dict[str, str] = {}
            for chunk in _chunks(keys):
                claimed.update(db.execute(f"SELECT key, owner FROM claims WHERE key IN ({_marks(chunk)})", chunk))
                answered.update(row[0] for row in db.execute(
                    f"SELECT key FROM annotations WHERE key IN ({_marks(chunk)}) AND preference IS NOT NULL", chunk))
                batched.update(open_batch_keys(db, chunk))
            for key in keys:
                if key in answered:
                    lost[key] = "answered"
                elif key in batched:
                    lost[key] = batched[key]
                elif claimed.get(key) != owner:
                    lost[key] = f"claimed by {claimed[key]}" if key in claimed else "not claimed"
            if lost:
                raise BatchConflict(lost)
            db.execute(f"INSERT INTO batches ({', '.join(COLUMNS)}) VALUES ({_marks(COLUMNS)})",
                       (batch_id, None, annotator, model, endpoint, "submitting", None, len(requests), len(keys),
                        max_cost_usd, None, None, os.getpid(), HOST, run, now, None, now, None))
            db.executemany("INSERT INTO batch_requests (batch_id, custom_id, keys, body_sha256, tokens_in_bound) "
                           "VALUES (?,?,?,?,?)", [(batch_id, r.custom_id, json.dumps(r.keys), r.body_sha256,
                                                   r.tokens_in_bound) for r in requests])
            db.executemany("INSERT INTO batch_pairs VALUES (?,?)", [(key, batch_id) for key in keys])
            db.executemany("DELETE FROM claims WHERE key = ? AND owner = ?", [(key, owner) for key in keys])

    def submitted(self, batch_id: str, remote_id: str, input_file_id: str | None, remote_status: str | None) -> None:
        """The provider accepted the batch: remember its id (state ``pending``)."""
        now = time.time()
        with self.cache.errors("record a batch in"), self.cache.transaction() as db:
            db.execute("UPDATE batches SET remote_id = ?, input_file_id = ?, remote_status = ?, state = 'pending', "
                       "submitted = ?, updated = ? WHERE id = ? AND state = 'submitting'",
                       (remote_id, input_file_id, remote_status, now, now, batch_id))

    def abandon(self, batch_id: str, error: str) -> None:
        """The provider never created this recorded batch: close it at no cost, its pairs free again."""
        with self.cache.errors("record a batch in"), self.cache.transaction() as db:
            db.execute("UPDATE batches SET state = 'abandoned', cost_usd = 0, error = ?, updated = ? "
                       "WHERE id = ? AND state = 'submitting'", (error[:500], time.time(), batch_id))

    def forget(self, batch_id: str, error: str) -> bool:
        """Close a pending batch the provider no longer knows, booking nothing; its pairs are free again. False
        when it was no longer pending (collected or forgotten by another process meanwhile)."""
        with self.cache.errors("record a batch in"), self.cache.transaction() as db:
            changed = db.execute("UPDATE batches SET state = 'forgotten', error = ?, updated = ? WHERE id = ? AND "
                                 "state = 'pending'", (error[:500], time.time(), batch_id)).rowcount
        return changed == 1

    def take_over(self, batch: BatchRecord, stale_after_s: float) -> bool:
        """Make this process the submitter of a ``submitting`` batch whose submitter died (killed between
        recording and submitting it); False when it is alive, or another process took it first."""
        if claim_alive(batch.pid, batch.host, batch.updated, time.time(), stale_after_s):
            return False
        with self.cache.errors("record a batch in"), self.cache.transaction() as db:
            changed = db.execute("UPDATE batches SET pid = ?, host = ?, updated = ? WHERE id = ? AND "
                                 "state = 'submitting' AND pid = ? AND host = ?",
                                 (os.getpid(), HOST, time.time(), batch.id, batch.pid, batch.host)).rowcount
        return changed == 1

    def update_status(self, batch_id: str, remote_status: str) -> None:
        with self.cache.errors("record a batch in"):
            self.cache.connection().execute("UPDATE batches SET remote_status = ?, updated = ? WHERE id = ?",
                                          (remote_status, time.time(), batch_id))

    def collect(self, batch_id: str, bookings: Sequence[dict[str, Any]], *, remote_status: str,
                error: str | None) -> bool:
        """Book a finished batch's answers (one ledger row per answered request, with its annotations) and close it,
        in one transaction; False (booking nothing) when another process collected it first."""
        now = time.time()
        with self.cache.errors("store a batch's answers in"), self.cache.transaction() as db:
            state = db.execute("SELECT state FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if state is None or state[0] != "pending":
                return False
            for booking in bookings:
                insert_request(db, booking["request_id"], now, booking["annotator"], booking["model"],
                               booking["entries"], tokens_in=booking["tokens_in"],
                               tokens_out=booking["tokens_out"], price_usd=booking["price_usd"],
                               latency_s=booking["latency_s"], attempts=1, parsed=booking["parsed"],
                               keys=booking["keys"], run=booking["run"], owner=None)
            db.execute("UPDATE batches SET state = 'collected', remote_status = ?, cost_usd = ?, error = ?, "
                       "updated = ? WHERE id = ?",
                       (remote_status, sum(b["price_usd"] for b in bookings), error, now, batch_id))
        return True

    # ---------------------------------------------------------------------------------------------- reading
    def batches(self, *, open_only: bool = True, annotator: str | None = None) -> list[BatchRecord]:
        """Batches recorded in the cache, oldest first (only open ones by default; of one annotator)."""
        query = f"SELECT {', '.join(COLUMNS)} FROM batches WHERE 1=1"
        args: list[Any] = []
        if open_only:
            query += f" AND state IN ({_marks(OPEN_BATCH_STATES)})"
            args += OPEN_BATCH_STATES
        if annotator is not None:
            query += " AND annotator = ?"
            args.append(annotator)
        with self.cache.errors("read batches of"):
            return [BatchRecord(*row) for row in self.cache.connection().execute(query + " ORDER BY created", args)]

    def for_keys(self, keys: Sequence[str]) -> dict[str, BatchRecord]:
        """The open batches that cover any of ``keys``, by local id."""
        with self.cache.errors("read batches of"):
            db = self.cache.connection()
            ids: set[str] = set()
            for chunk in _chunks(keys):
                ids.update(row[0] for row in db.execute(
                    f"SELECT DISTINCT p.batch_id FROM batch_pairs p JOIN batches b ON b.id = p.batch_id WHERE "
                    f"p.key IN ({_marks(chunk)}) AND b.state IN ({_marks(OPEN_BATCH_STATES)})",
                    [*chunk, *OPEN_BATCH_STATES]))
        return {record.id: record for record in self.batches() if record.id in ids}

    def get(self, batch_id: str) -> BatchRecord | None:
        with self.cache.errors("read batches of"):
            row = self.cache.connection().execute(f"SELECT {', '.join(COLUMNS)} FROM batches WHERE id = ?",
                                                (batch_id,)).fetchone()
        return BatchRecord(*row) if row else None

    def requests(self, batch_id: str) -> list[BatchRequest]:
        with self.cache.errors("read batches of"):
            rows = self.cache.connection().execute(
                "SELECT custom_id, keys, body_sha256, tokens_in_bound FROM batch_requests WHERE batch_id = ?",
                (batch_id,)).fetchall()
        return [BatchRequest(custom_id, json.loads(keys), sha, bound) for custom_id, keys, sha, bound in rows]

    def booked(self, batch_id: str) -> LedgerTotals:
        """The ledger rows a batch's collection booked (their ids start with the batch's local id, see
        :func:`booking_id`): what it cost, for the run that submitted it."""
        prefix = booking_id(batch_id, "")
        with self.cache.errors("read the ledger of"):
            n, t_in, t_out, price = self.cache.connection().execute(
                "SELECT COUNT(*), COALESCE(SUM(tokens_in),0), COALESCE(SUM(tokens_out),0), COALESCE(SUM(price_usd),0) "
                "FROM requests WHERE substr(id, 1, ?) = ?", (len(prefix), prefix)).fetchone()
        return LedgerTotals(n, t_in, t_out, price)


def booking_id(batch_id: str, custom_id: str, copy: int = 0) -> str:
    """The ledger row id of one answered line of a batch (``copy``: the provider listed it more than once)."""
    return f"batch:{batch_id}:" + (f"{custom_id}:{copy}" if custom_id else "")


def _chunks(keys: Sequence[str], size: int = 500) -> list[list[str]]:
    return [list(keys[start:start + size]) for start in range(0, len(keys), size)]


def _marks(items: Sequence[Any]) -> str:
    return ",".join("?" * len(items))

