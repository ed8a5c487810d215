"""One ``annotate`` call of a :class:`~alpacafarm_annotators.prompted.PromptedAnnotator`: claim the pairs in the
cache, send the requests (batched, retried, renewed claims before each send, the budget checked), record every paid
answer with its ledger row, and hold paid answers a full disk could not store. The guarantees are the annotator's
(see :mod:`alpacafarm_annotators.prompted`); this module is how one call keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from alpacafarm.annotation import ProgressCallback
from alpacafarm.annotation_cache import CacheError
from alpacafarm.errors import UserError
from alpacafarm.types import Annotation, Pair
from alpacafarm_annotators.endpoint_requests import (
    BudgetExceeded,
    Completion,
    RateLimiter,
    RequestFailed,
    complete,
)
from alpacafarm_annotators.provider_numbers import describe_pairs

logger = logging.getLogger("alpacafarm.annotators")


class ClaimLost(Exception):
    """Raised right before a request: some of its pairs are no longer this call's to pay for (``lost``:
    key -> "answered" or the process that took them over while this one was paused)."""

    def __init__(self, lost: dict[str, str]) -> None:
        super().__init__(f"{len(lost)} claim(s) lost")
        self.lost = lost


class AnnotationCall:
    """One ``aannotate`` call's requests: claims, batches, pair-by-pair re-asks, waiting for other processes, and a
    circuit breaker (an endpoint that failed every request so far, or three in a row, gets no more requests)."""

    def __init__(self, judge: Any, pairs: Sequence[Pair], keys: list[str],
                 results: list[Annotation | None], progress: ProgressCallback | None, replicate: int) -> None:
        self.judge, self.pairs, self.keys, self.results = judge, pairs, keys, results
        self.progress, self.replicate = progress, replicate
        self.cache = judge.cache
        self.config = judge.config
        self.owner = f"{judge.run_id}:{uuid.uuid4().hex[:8]}"
        self.index = {}  # key -> index of its first occurrence (set in run)
        self.answered = 0
        self.failures_in_a_row = 0
        self.broken: str | None = None  # the error that made the breaker stop sending
        self.refused: list[Exception] = []  # a budget stop or a refused request: stop scheduling, keep what is done
        self.held: list[dict[str, Any]] = []  # paid answers the cache could not store yet (a full disk)
        self.secrets = judge.secrets()
        self.client: Any = None
        self.limiter = RateLimiter(self.config.requests_per_minute)
        self.semaphore = asyncio.Semaphore(self.config.max_concurrency)

    async def run(self, todo: list[int]) -> None:
        self.index = {self.keys[i]: i for i in todo}
        self.client = self.judge._make_client()  # before claiming: a missing key claims nothing
        heartbeat = None
        try:
            mine, busy = todo, {}
            if self.cache is not None:
                mine, busy = self._claim([self.keys[i] for i in todo])
                interval = min(30.0, max(0.05, self.config.claim_stale_s / 4))
                heartbeat = asyncio.create_task(self._heartbeat(interval))
            await asyncio.gather(self._request(mine), self._wait(busy))
            if self.held:
                await self._flush_held(self.config.cache_flush_wait_s)
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            await self.client.close()
            if self.cache is not None:
                with contextlib.suppress(CacheError):  # a broken cache is reported below, not hidden by this
                    self.cache.release(self.owner)  # whatever is left (a stop, an exception): others may pay for it
        error: UserError | None = None
        if self.held:
            error = CacheError(f"{self.held[0]['error']}; {len(self.held)} paid answer(s) could not be stored "
                               f"after retrying for {self.config.cache_flush_wait_s:g}s: they are in this call's "
                               "results, but a later run will pay for them again")
        elif self.refused:
            done = sum(r is not None and r.outcome != "failed" for r in self.results)
            first = self.refused[0]
            where = "" if isinstance(first, (BudgetExceeded, CacheError)) else f"{self.judge.endpoint}: "
            error = type(first)(f"{where}{first} ({done}/{len(self.results)} pairs annotated)")
        if error is not None:
            # what was paid for is not thrown away with the exception: a caller may still write it out
            error.partial = [r if r is not None else self.judge._failed(f"not sent: {error}") for r in self.results]
            raise error

    def _claim(self, keys: list[str]) -> tuple[list[int], dict[int, str]]:
        """Claim ``keys``: (indices to pay for, {index: owner} held by live processes); answers found are filled."""
        claimed = self.cache.claim(keys, self.owner, stale_after_s=self.config.claim_stale_s,
                                   reask_unparsed=self.config.reask_unparsed)
        if claimed.taken_over:
            logger.warning("%s: took over %d claim(s) of dead processes", self.judge.name, claimed.taken_over)
        found = self.cache.get_many(claimed.done, self.config.reask_unparsed) if claimed.done else {}
        self._fill(found)
        for key, batch in claimed.batched.items():  # its answer comes when that batch is collected, maybe in hours
            self.results[self.index[key]] = self.judge._failed(
                f"this pair is in {batch} (mode: batch), not yet collected: re-run with mode: batch to collect it, "
                f"cancel it with alpacafarm annotate --batch-cancel {batch.removeprefix('batch ')}, or, if its "
                f"provider no longer knows it, release it with alpacafarm annotate --batch-forget "
                f"{batch.removeprefix('batch ')}")
        self._advance(list(self.index[k] for k in claimed.batched))
        return [self.index[k] for k in claimed.mine], {self.index[k]: who for k, who in claimed.busy.items()}

    def _fill(self, found: dict[str, Annotation]) -> None:
        for key, annotation in found.items():
            self.results[self.index[key]] = annotation
        if self.progress and found:
            self.progress(len(found), 0.0)

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.cache.heartbeat(self.owner)
            except CacheError as exc:  # a busy database: try again at the next beat
                logger.warning("%s: claim heartbeat skipped (%s)", self.judge.name, exc)

    async def _before_send(self, keys: list[str]) -> None:
        """Right before a request is sent (every attempt): store held answers first (a cache that still cannot be
        written stops the call here, before more is paid for), then renew this call's claims on ``keys``."""
        if self.held:
            self._retry_held()
            if self.held:
                raise self.held[0]["error"]
        if self.cache is not None:
            lost = self.cache.renew(keys, self.owner, reask_unparsed=self.config.reask_unparsed)
            if lost:
                raise ClaimLost(lost)

    def _retry_held(self) -> None:
        still = []
        for booking in self.held:
            try:
                self.cache.record_batch(**{k: v for k, v in booking.items() if k != "error"})
            except CacheError as exc:
                still.append({**booking, "error": exc})
        self.held = still

    async def _flush_held(self, wait_s: float) -> None:
        """Store the held answers, retrying for up to ``wait_s`` seconds (space may be freed meanwhile)."""
        deadline = time.monotonic() + wait_s
        self._retry_held()
        if self.held:
            logger.warning("%s: %s; %d paid answer(s) kept in memory, retrying to store them for %gs",
                           self.judge.name, self.held[0]["error"], len(self.held), wait_s)
        while self.held and time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            self._retry_held()

    def _record(self, completion: Completion, keys: list[str], entries: list[tuple[str, Annotation]],
                parsed: bool) -> None:
        booking = self.judge.record(completion, keys, entries, parsed, self.owner)
        if booking is not None:  # paid, but not stored: hold it; the next request first tries to store it
            logger.warning("%s: %s; the answer is kept in memory", self.judge.name, booking["error"])
            self.held.append(booking)

    def _stop_reason(self) -> str | None:
        """Why no request should be retried now (the breaker tripped, or the call was stopped), or None."""
        if self.broken is not None:
            return f"the endpoint kept failing: {self.broken}"
        return str(self.refused[0]) if self.refused else None

    def _advance(self, indices: list[int]) -> None:
        if self.progress and indices:
            self.progress(len(indices), 0.0)

    async def _wait(self, busy: dict[int, str]) -> None:
        """Wait for pairs other live processes are paying for; take over those released or left by dead owners."""
        deadline = time.monotonic() + self.config.claim_wait_s
        while busy:
            await asyncio.sleep(self.config.claim_poll_s)
            mine, still = self._claim([self.keys[i] for i in busy])
            busy = still
            if mine:
                await self._request(mine)
            if busy and time.monotonic() > deadline:
                for i, who in busy.items():
                    self.results[i] = self.judge._failed(
                        f"another process ({who}) was still annotating this pair after claim_wait_s="
                        f"{self.config.claim_wait_s:g}s")
                self._advance(list(busy))
                return

    async def _request(self, indices: list[int]) -> None:
        size = self.config.batch_size
        await asyncio.gather(*(self._run_batch(indices[s:s + size]) for s in range(0, len(indices), size)))

    def _stopped(self, indices: list[int]) -> bool:
        """Fail ``indices`` without a request when the breaker tripped or a refusal stopped the call."""
        if self.broken is None and not self.refused:
            return False
        error = (f"not sent: the endpoint kept failing ({self.broken})" if self.broken is not None
                 else f"not sent: {self.refused[0]}")
        for i in indices:
            self.results[i] = self.judge._failed(error)
        if self.cache is not None:
            with contextlib.suppress(CacheError):
                self.cache.release(self.owner, [self.keys[i] for i in indices])
        return True

    async def _run_batch(self, indices: list[int]) -> None:
        async with self.semaphore:
            if self._stopped(indices):
                self._advance(indices)
                return
            try:
                annotations = await self._batch(indices)
            except ClaimLost as exc:
                lost = exc.lost
            except UserError as exc:
                self.refused.append(exc)
                self._stopped([i for i in indices if self.results[i] is None])
                self._advance(indices)
                return
            else:
                for i, annotation in zip(indices, annotations, strict=True):
                    self.results[i] = annotation
                if self.progress:
                    self.progress(len(indices), sum(a.price_usd for a in annotations))
                return
        # Another process holds (or answered) these pairs now: this one was paused past claim_stale_s. Wait for
        # its answers, outside the semaphore, instead of paying for them again.
        waiting = {i: lost.get(self.keys[i], "another process") for i in indices}
        logger.warning("%s: %d pair(s) were taken over by another process while this one was paused; "
                       "waiting for its answers instead of paying again", self.judge.name, len(waiting))
        await self._wait(waiting)

    async def _batch(self, indices: list[int]) -> list[Annotation]:
        """Ask for ``indices`` in one request (re-asked ``parse_retries`` times when unreadable); a batch that never
        parses is asked pair by pair, and only a pair whose own answers never parse is given up as unparsed."""
        judge, batch = self.judge, [self.pairs[i] for i in indices]
        keys = [self.keys[i] for i in indices]
        prompt = judge.render(batch)
        spent = [0, 0, 0.0, 0.0]  # tokens in, tokens out, price, latency of the unreadable answers
        for attempt in range(1 + self.config.parse_retries):
            estimate = judge._estimate(prompt)
            judge.budget.reserve(estimate)
            try:
                completion = await complete(
                    self.client, style=self.config.style, model=judge.model, prompt=prompt,
                    decoding=judge.decoding(self.replicate, attempt, keys), logprobs=self.config.logprobs,
                    max_retries=self.config.max_retries, timeout_s=self.config.timeout_s, limiter=self.limiter,
                    backoff_s=self.config.retry_backoff_s, max_backoff_s=self.config.max_backoff_s,
                    connect_retries=self.config.connect_retries, timeout_retries=self.config.timeout_retries,
                    secrets=self.secrets, before_send=lambda k=keys: self._before_send(k), stop=self._stop_reason)
            except RequestFailed as exc:
                judge.budget.settle(estimate, 0.0)
                return self._request_failed(indices, str(exc))
            except BaseException:
                judge.budget.settle(estimate, 0.0)
                raise
            judge.count_tokens_itself(completion, describe_pairs(keys, dict(zip(keys, batch, strict=True))),
                                      prompt=prompt)  # no usage, or numbers that cannot be true: an upper bound
            judge.budget.settle(estimate, judge.cost(completion.tokens_in, completion.tokens_out))
            self.answered += 1
            self.failures_in_a_row = 0
            labels = judge.parse(completion, len(batch))
            last = attempt == self.config.parse_retries
            n = len(batch)
            if labels is None and not (last and n == 1):  # paid, but nothing to keep: a ledger row, no answers
                price = judge.cost(completion.tokens_in, completion.tokens_out)
                self._record(completion, keys, [], False)
                spent = [spent[0] + completion.tokens_in, spent[1] + completion.tokens_out, spent[2] + price,
                         spent[3] + completion.latency_s]
                continue
            price = judge.cost(completion.tokens_in, completion.tokens_out)
            cut = " (cut off at max_tokens: raise decoding.max_tokens)" if completion.finish_reason == "length" else ""
            metadata = {} if labels is not None else {"error": f"unparsed: the answer could not be read{cut}",
                                                      "endpoint": judge.endpoint}
            annotations = [
                Annotation(label, judge.name, completion.text, (completion.tokens_in + spent[0]) // n,
                           (completion.tokens_out + spent[1]) // n, (price + spent[2]) / n,
                           (completion.latency_s + spent[3]) / n, metadata=dict(metadata),
                           outcome=None if labels is not None else "unparsed")
                for label in (labels or [None])
            ]
            self._record(completion, keys, list(zip(keys, annotations, strict=True)), labels is not None)
            return annotations
        out = []  # the batch never parsed: each pair on its own, so one bad pair cannot take its neighbours along
        for i in indices:
            if self._stopped([i]):
                out.append(self.results[i])
                continue
            (single,) = await self._batch([i])
            if single.outcome != "failed":  # the batch's unreadable answers were paid for these pairs too
                single.tokens_in += spent[0] // len(indices)
                single.tokens_out += spent[1] // len(indices)
                single.price_usd += spent[2] / len(indices)
                single.latency_s += spent[3] / len(indices)
            out.append(single)
        return out

    def _request_failed(self, indices: list[int], error: str) -> list[Annotation]:
        """No answer after the retries: failed (never cached), claims released; maybe trip the breaker."""
        self.failures_in_a_row += 1
        if self.broken is None and (self.answered == 0 or self.failures_in_a_row >= 3):
            self.broken = error
        if self.cache is not None:
            with contextlib.suppress(CacheError):
                self.cache.release(self.owner, [self.keys[i] for i in indices])
        return [self.judge._failed(error) for _ in indices]
