"""One ``annotate`` call of a prompted annotator in ``mode: batch``: the requests the live path would send, sent as
batch files, each recorded in the annotation cache before it is uploaded (:mod:`alpacafarm.annotation_batches`).

The call loops until every pair has an answer or ``batch_wait_s`` has passed:

1. pairs already answered (cache) are served; pairs in an open batch — this run's, or one a killed or closed run
   submitted hours ago — are waited for by polling *that* batch (never submitted again);
2. the other pairs are claimed like live requests (a pair another process is paying for is waited for), grouped
   ``batch_size`` per request exactly as the live path groups them (the same bodies), priced at the batch rate;
   a batch whose worst case exceeds what is left of ``max_cost_usd`` is refused before it is recorded; then it is
   recorded, uploaded and created;
3. batches are polled with back-off (``batch_poll_s`` doubling to ``batch_max_poll_s``); a finished one
   (completed, expired, cancelled, failed) is downloaded and booked once, and the pairs it returned no answer
   for are submitted again (at most ``batch_resubmits`` times per call; a later run tries again). An answer that
   cannot be read is sent again pair by pair, as the live path re-asks; a single pair's unreadable answer is
   ``unparsed``. Its ``usage`` is checked as the live path checks it (a count that cannot be true is booked at
   the judge's upper bound, the answer kept); a ``custom_id`` the provider lists twice is never bought again
   (see :class:`~alpacafarm_annotators.batch_api.LineResult`). Its cost is the submitting run's, whoever
   collects it (a collector serves those answers as cached).

A batch the provider no longer knows (404 for it or its output file) stops the call with one line naming
``alpacafarm annotate --batch-forget ID`` (:mod:`.batch_maintenance`), the only way its pairs are freed.

When ``batch_wait_s`` passes with batches still pending, the call raises
:class:`~alpacafarm.annotation.AnnotationPending` ("batch pending, re-run to collect", exit status 75).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

from alpacafarm.annotation import AnnotationFailed, AnnotationPending, ProgressCallback
from alpacafarm.annotation_batches import BatchConflict, BatchLedger, BatchRecord, BatchRequest, booking_id
from alpacafarm.annotation_cache import OPEN_BATCH_STATES, CacheError
from alpacafarm.errors import UserError
from alpacafarm.types import Annotation, Pair
from alpacafarm_annotators.batch_api import (
    TERMINAL,
    BatchAPI,
    BatchUnknown,
    BodyCapture,
    LineResult,
    body_sha256,
    completion_of,
    line_bytes,
)
from alpacafarm_annotators.endpoint_requests import RequestFailed, endpoint_path
from alpacafarm_annotators.provider_numbers import describe_pairs, seconds_between

logger = logging.getLogger("alpacafarm.annotators")


def _age(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 \
        else f"{seconds:.0f} s"


class BatchCall:
    """One batch-mode ``aannotate`` call (or, with no pairs, the annotator's batch maintenance: cancel, forget; see
    :mod:`.batch_maintenance`)."""

    def __init__(self, judge: Any, pairs: Sequence[Pair], keys: Sequence[str],
                 results: list[Annotation | None], progress: ProgressCallback | None, replicate: int) -> None:
        self.judge, self.pairs, self.keys, self.results = judge, pairs, keys, results
        self.progress, self.replicate = progress, replicate
        self.config = judge.config
        self.cache = judge.cache
        self.ledger = BatchLedger(judge.cache)
        self.owner = f"{judge.run_id}:{uuid.uuid4().hex[:8]}"
        self.index: dict[str, int] = {}
        self.sent: dict[str, int] = {}  # key -> submissions in this call
        self.alone: set[str] = set()  # keys whose shared answer could not be read: one pair per request
        self.errors: dict[str, str] = {}  # key -> why its last batch returned nothing for it
        self.reserved: dict[str, float] = {}  # batch id -> worst case reserved against the budget in this call
        self.api: BatchAPI | None = None

    # ------------------------------------------------------------------------------------------------ the loop
    async def run(self, todo: list[int]) -> None:
        self.index = {self.keys[i]: i for i in todo}
        client = self.open_api()
        try:
            await self._loop()
        except RequestFailed as exc:
            raise AnnotationFailed(f"{self.judge.name}: {exc}; the batches are recorded in the annotation cache: a "
                                   "re-run polls them and submits nothing again") from None
        finally:
            await client.close()
            with contextlib.suppress(CacheError):
                self.cache.release(self.owner)

    async def _loop(self) -> None:
        remaining = [self.keys[i] for i in self.index.values()]
        deadline = time.monotonic() + self.config.batch_wait_s
        claim_deadline = time.monotonic() + self.config.claim_wait_s
        delay = self.config.batch_poll_s
        while True:
            remaining = self._serve_cached(remaining)
            self._settle_closed()
            if not remaining:
                return
            batches = self.ledger.for_keys(remaining)
            covered = {k for b in batches for request in self.ledger.requests(b) for k in request.keys}
            free = [k for k in remaining if k not in covered]
            busy = await self._submit_free(free, batches)
            if not batches and not busy:
                continue  # everything free was answered, submitted or failed: look again
            progressed = False
            for batch in list(batches.values()):
                progressed |= await self._advance(batch)
            if progressed:
                delay = self.config.batch_poll_s
                continue
            now = time.monotonic()
            if busy and now > claim_deadline:
                for key, who in busy.items():
                    self._fail(key, f"another process ({who}) was still annotating this pair after claim_wait_s="
                                    f"{self.config.claim_wait_s:g}s")
                continue
            if batches and now >= deadline:
                raise self._pending(batches)
            await asyncio.sleep(max(0.0, min(delay, deadline - now)) if batches else self.config.claim_poll_s)
            delay = min(delay * 2, self.config.batch_max_poll_s)

    def _serve_cached(self, keys: list[str]) -> list[str]:
        """Fill the answers the cache has (another process's collection included); the keys still without one."""
        open_keys = [k for k in keys if self.results[self.index[k]] is None]
        found = self.cache.get_many(open_keys, self.config.reask_unparsed) if open_keys else {}
        for key, annotation in found.items():
            self.results[self.index[key]] = annotation
        if self.progress and found:
            self.progress(len(found), 0.0)
        return [k for k in open_keys if k not in found]

    def _settle_closed(self) -> None:
        """This call's batches that another process closed meanwhile (collected, forgotten): their cost is this
        run's (it submitted them), so it is settled against the reservation and counted in this run's usage."""
        for batch_id in list(self.reserved):
            record = self.ledger.get(batch_id)
            if record is None or record.state in OPEN_BATCH_STATES:
                continue
            booked = self.ledger.booked(batch_id) if record.state == "collected" else None
            self.judge.budget.settle(self.reserved.pop(batch_id), booked.price_usd if booked else 0.0)
            if booked is not None:
                self.judge._usage.add(booked.tokens_in, booked.tokens_out, booked.price_usd, requests=booked.requests)

    def _fail(self, key: str, error: str) -> None:
        self.results[self.index[key]] = self.judge._failed(error)
        if self.progress:
            self.progress(1, 0.0)

    def _pending(self, batches: dict[str, BatchRecord]) -> AnnotationPending:
        n = sum(r is None for r in self.results)
        oldest = min(b.created for b in batches.values())
        ids = ", ".join(b.label for b in list(batches.values())[:3]) + (", ..." if len(batches) > 3 else "")
        return AnnotationPending(
            f"{self.judge.name}: batch pending, re-run to collect: {n} pair(s) in {len(batches)} batch(es) at "
            f"{self.judge.endpoint} ({ids}; oldest {_age(time.time() - oldest)}, after batch_wait_s="
            f"{self.config.batch_wait_s:g}s); they are recorded in the annotation cache, so a re-run polls them and "
            "submits nothing again (alpacafarm annotate --batch-status lists them)")

    # ------------------------------------------------------------------------------------------------ submit
    async def _submit_free(self, free: list[str], batches: dict[str, BatchRecord]) -> dict[str, str]:
        """Claim and submit ``free`` keys (adding their batches to ``batches``); returns those busy elsewhere."""
        exhausted = [k for k in free if self.sent.get(k, 0) > self.config.batch_resubmits]
        for key in exhausted:
            self._fail(key, f"{self.errors.get(key, 'no answer')}; submitted {self.sent[key]} times in this run "
                            "(batch_resubmits): a re-run submits it again")
        free = [k for k in free if k not in exhausted]
        if not free:
            return {}
        claimed = self.cache.claim(free, self.owner, stale_after_s=self.config.claim_stale_s,
                                   reask_unparsed=self.config.reask_unparsed)
        if claimed.taken_over:
            logger.warning("%s: took over %d claim(s) of dead processes", self.judge.name, claimed.taken_over)
        mine = set(claimed.mine)
        ordered = [k for k in free if k in mine]  # the caller's order, as the live path groups its requests
        groups = [[k] for k in ordered if k in self.alone]
        rest = [k for k in ordered if k not in self.alone]
        size = self.config.batch_size
        groups += [rest[s:s + size] for s in range(0, len(rest), size)]
        step = self.config.batch_max_requests
        for start in range(0, len(groups), step):
            record = await self._submit(groups[start:start + step])
            if record is not None:
                batches[record.id] = record
        return claimed.busy

    async def _submit(self, groups: list[list[str]]) -> BatchRecord | None:
        assert self.api is not None
        judge = self.judge
        local_id = uuid.uuid4().hex
        url = endpoint_path(self.config.style)
        lines, requests, estimate = [], [], 0.0
        capture = BodyCapture()
        try:
            for j, group in enumerate(groups):
                prompt = judge.render([self.pairs[self.index[k]] for k in group])
                body = await capture.body(self.config.style, judge.model, prompt,
                                          judge.decoding(self.replicate, 0, group), self.config.logprobs,
                                          self.config.timeout_s)
                custom_id = f"{local_id[:12]}-{j}"
                lines.append(line_bytes(custom_id, url, body))
                requests.append(BatchRequest(custom_id, group, body_sha256(body), judge.counted_tokens(prompt, "")[0]))
                estimate += judge._estimate(prompt)
        finally:
            await capture.close()
        keys = [k for group in groups for k in group]
        try:
            judge.budget.reserve(estimate)  # refused up front: nothing recorded, nothing sent
        except Exception:
            self.cache.release(self.owner, keys)
            raise
        try:
            self.ledger.open(local_id, annotator=judge.name, model=judge.model, endpoint=judge.endpoint,
                             requests=requests, max_cost_usd=estimate, owner=self.owner, run=judge.run_id,
                             stale_after_s=self.config.claim_stale_s)
        except BatchConflict as exc:  # another process answered or batched some of them meanwhile: plan again
            judge.budget.settle(estimate, 0.0)
            self.cache.release(self.owner, keys)
            logger.warning("%s: %s; planning the batch again", judge.name, exc)
            return None
        self.reserved[local_id] = estimate
        for key in keys:
            self.sent[key] = self.sent.get(key, 0) + 1
        try:
            file_id = await self.api.upload(local_id, b"".join(lines))
        except BaseException as exc:  # no file, so no batch: close the record, its pairs are free again
            self._abandon(local_id, f"the batch file was not uploaded: {exc}")
            raise
        try:
            batch = await self.api.create(local_id, file_id, url=url, window=self.config.batch_completion_window,
                                          since=time.time())
        except UserError as exc:  # refused: nothing was created
            self._abandon(local_id, str(exc))
            raise
        if batch is None:  # every create failed, and the provider has no such batch: its pairs are free again
            self._abandon(local_id, "the batch could not be created")
            raise RequestFailed(f"could not create a batch at {judge.endpoint} after {1 + self.config.max_retries} "
                                "tries")
        self.ledger.submitted(local_id, batch.id, file_id, batch.status)
        logger.info("%s: submitted batch %s (%d requests, %d pairs, up to $%.4f)", judge.name, batch.id,
                    len(requests), len(keys), estimate)
        return self._open_record(local_id)

    def _open_record(self, batch_id: str) -> BatchRecord | None:
        """The batch's record while it is open (None once abandoned: its pairs are free again)."""
        record = self.ledger.get(batch_id)
        return record if record is not None and record.state in OPEN_BATCH_STATES else None

    def _abandon(self, batch_id: str, error: str) -> None:
        with contextlib.suppress(CacheError):  # the error being raised says more than a busy cache would
            self.ledger.abandon(batch_id, error)
        self.judge.budget.settle(self.reserved.pop(batch_id, 0.0), 0.0)

    async def _repair(self, record: BatchRecord | None) -> None:
        """A ``submitting`` record whose submitter stopped: adopt the provider's batch, or abandon the record."""
        if record is None or record.state != "submitting":
            return
        assert self.api is not None
        found = await self.api.find(record.id, record.created)
        if found is not None:
            self.ledger.submitted(record.id, found.id, found.input_file_id, found.status)
            logger.warning("%s: batch %s was submitted by a process that stopped before recording it; adopted",
                           self.judge.name, found.id)
        else:
            self._abandon(record.id, "never created at the provider (the submitter stopped first)")

    # ------------------------------------------------------------------------------------------------ poll, collect
    async def _advance(self, record: BatchRecord) -> bool:
        """Poll one open batch; collect it when finished. True when something changed for this call's pairs."""
        assert self.api is not None
        if record.endpoint != self.judge.endpoint:  # this client cannot poll (or repair) another endpoint's batch
            raise UserError(f"{self.judge.name}: pairs are in batch {record.label} at {record.endpoint}, but this "
                            f"annotator's endpoint is {self.judge.endpoint}: set base_url back to collect it, or "
                            "cancel it there (alpacafarm annotate --batch-cancel)")
        if record.state not in OPEN_BATCH_STATES:  # closed meanwhile (collected or abandoned by another process)
            return True
        if record.state == "submitting":
            if record.pid == os.getpid() and record.id in self.reserved:
                return False
            if self.ledger.take_over(record, self.config.claim_stale_s):
                await self._repair(record)
                return True
            return False
        try:
            batch = await self.api.retrieve(record.remote_id)
            if batch.status not in TERMINAL:
                if batch.status != record.remote_status:
                    self.ledger.update_status(record.id, batch.status)
                return False
            await self.collect(record, batch)
        except BatchUnknown as exc:  # never collected, never re-sent by itself: the user decides (--batch-forget)
            raise UserError(self._unknown(record, exc)) from None
        return True

    def _unknown(self, record: BatchRecord, exc: BatchUnknown) -> str:
        """The one line for a batch its provider no longer knows, and the way out."""
        base = f" --base-url {record.endpoint}" if self.config.base_url else ""
        return (f"{self.judge.name}: the provider no longer knows batch {record.label} ({exc.detail}), so it can "
                f"never be collected, and its {record.n_pairs} pair(s) stay reserved for it; release them with: "
                f"alpacafarm annotate --annotator {record.annotator}{base} --batch-forget {record.label} (it books "
                "nothing in the ledger: what the provider may have billed for it is unknown here; the next run "
                "submits those pairs, and pays for them, again)")

    async def collect(self, record: BatchRecord, batch: Any) -> None:
        """Download a finished batch and book its answers once (another process may have booked them first). The
        cost is the submitting run's: counted in this run's usage and budget only when this run submitted it."""
        assert self.api is not None
        judge = self.judge
        lines = await self.api.results(batch)
        ended = batch.completed_at or batch.expired_at or batch.cancelled_at or batch.failed_at or time.time()
        elapsed = seconds_between(batch.created_at, ended)
        bookings, mine = [], {}
        known = {k: self.pairs[i] for k, i in self.index.items()}  # to name pairs in messages
        for request in self.ledger.requests(record.id):
            rows, entries = self._booking(record, request, lines.get(request.custom_id), elapsed, known)
            bookings += rows
            mine.update({k: a for k, a in entries if k in self.index})
        error = _batch_error(batch)
        if not self.ledger.collect(record.id, bookings, remote_status=batch.status, error=error):
            return  # another process booked it: its answers are served from the cache (and settled if ours)
        cost = sum(b["price_usd"] for b in bookings)
        ours = record.id in self.reserved or (record.run is not None and record.run == judge.run_id)
        if ours:
            for booking in bookings:
                judge._usage.add(booking["tokens_in"], booking["tokens_out"], booking["price_usd"])
            judge.budget.settle(self.reserved.pop(record.id, 0.0), cost)
        for key, annotation in mine.items():  # unparsed answers too: this call gave them up, like the live path
            if self.results[self.index[key]] is None:
                annotation.cached = not ours  # bought by another run: served to this one, not paid by it
                self.results[self.index[key]] = annotation
        if self.progress and mine:
            self.progress(len(mine), cost if ours else 0.0)
        logger.info("%s: collected batch %s (%s): %d answers, $%.4f%s", judge.name, record.label, batch.status,
                    len(bookings), cost, "" if ours else " (submitted by another run, which pays for it)")

    def _booking(self, record: BatchRecord, request: BatchRequest, line: LineResult | None, elapsed: float,
                 known: dict[str, Pair]) -> tuple[list[dict[str, Any]], list[tuple[str, Annotation]]]:
        """The ledger rows of one request (one per answer the provider returned for it: each was billed) and its
        annotations; ([], []) for a request without an answer (its pairs are submitted again)."""
        judge, n = self.judge, len(request.keys)
        if line is None or not line.answers:
            for key in request.keys:
                self.errors[key] = line.error if line is not None and line.error else "the batch returned no answer"
            return [], []
        rows, completions = [], []
        what = describe_pairs(request.keys, known)
        for copy, body in enumerate(line.answers):
            try:
                completion = completion_of(self.config.style, body, judge.secrets())
            except ValueError as exc:
                if copy == 0 and line.conflict is None:
                    for key in request.keys:
                        self.errors[key] = str(exc)
                    return [], []
                continue  # a further copy without choices: nothing to book
            judge.count_tokens_itself(completion, what, tokens_in_bound=request.tokens_in_bound)
            completion.latency_s = elapsed
            completions.append(completion)
            rows.append({"request_id": booking_id(record.id, request.custom_id, copy), "annotator": judge.name,
                         "model": judge.model, "tokens_in": completion.tokens_in, "tokens_out": completion.tokens_out,
                         "price_usd": judge.cost(completion.tokens_in, completion.tokens_out), "latency_s": elapsed,
                         "keys": request.keys, "run": record.run or judge.run_id, "entries": [], "parsed": False})
        if not rows:
            return [], []
        completion, booking = completions[0], rows[0]
        price = sum(row["price_usd"] for row in rows)
        if line.conflict is not None:  # two answers, no way to tell the judge's: given up, never re-bought here
            entries = [(key, Annotation(None, judge.name, None, completion.tokens_in // n, completion.tokens_out // n,
                                        price / n, elapsed / n, metadata={"error": f"unparsed: {line.conflict}",
                                                                          "endpoint": judge.endpoint},
                                        outcome="unparsed")) for key in request.keys]
            booking["entries"] = entries
            return rows, entries
        labels = judge.parse(completion, n)
        booking["parsed"] = labels is not None
        if labels is None and n > 1:  # paid, unreadable: each pair is asked again alone (as the live path does)
            self.alone.update(request.keys)
            for key in request.keys:
                self.errors[key] = "unparsed: the answer could not be read"
            return rows, []
        cut = " (cut off at max_tokens: raise decoding.max_tokens)" if completion.finish_reason == "length" else ""
        metadata = {} if labels is not None else {"error": f"unparsed: the answer could not be read{cut}",
                                                  "endpoint": judge.endpoint}
        entries = [(key, Annotation(label, judge.name, completion.text, completion.tokens_in // n,
                                    completion.tokens_out // n, price / n, elapsed / n, metadata=dict(metadata),
                                    outcome=None if labels is not None else "unparsed"))
                   for key, label in zip(request.keys, labels or [None], strict=True)]
        booking["entries"] = entries
        return rows, entries

    # ------------------------------------------------------------------------------------------------ maintenance
    def open_api(self) -> Any:
        """A client and the batch API on it, for the maintenance commands (:mod:`.batch_maintenance`)."""
        client = self.judge._make_client()
        self.api = BatchAPI(client, endpoint=self.judge.endpoint, max_retries=self.config.max_retries,
                            backoff_s=self.config.retry_backoff_s, max_backoff_s=self.config.max_backoff_s,
                            timeout_s=self.config.timeout_s, secrets=self.judge.secrets())
        return client


def _batch_error(batch: Any) -> str | None:
    errors = getattr(batch, "errors", None)
    data = getattr(errors, "data", None) or []
    if not data:
        return None
    first = data[0]
    return f"{getattr(first, 'code', None) or 'error'}: {getattr(first, 'message', None) or ''}"[:300]
