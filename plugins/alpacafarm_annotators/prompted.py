"""An LLM judge behind any OpenAI-compatible endpoint (OpenAI, vLLM, llama.cpp server, Ollama, TGI, ...).

Pairs are grouped into batches of ``batch_size`` per request, rendered with the annotator's prompt template and
read back with its parser. Every annotation ends with an outcome (``labelled``, ``tie``, ``unparsed``, ``failed``):

- An answer that cannot be read (wrong count, prose, empty ``content``) is asked for again ``parse_retries`` times
  (the paper: once). A batch that still does not parse is asked **pair by pair**; only a pair whose own answers
  never parse is given up as ``unparsed`` (``None``, never guessed) and cached as such, with how many calls gave
  it up: a later run asks for it again ``reask_unparsed`` more times (default once; each pays again), then serves
  it as unparsed. Its neighbours are never affected. An answer cut off at ``max_tokens`` says so in its error.
- A request that gets no answer after its retries (connection refused, timeouts, 429/5xx, garbage bodies) leaves
  its pairs ``failed``: never cached, asked again on the next run. An endpoint that failed every request so far,
  or three in a row, gets no further requests in this call (its remaining pairs fail at once, naming the first
  error and the endpoint), so a wrong ``base_url`` costs seconds, not minutes of backoff.
- Exactly once: a pair given twice is requested once; before requesting, the call claims its pairs in the cache
  (see ``alpacafarm.annotation_cache``); pairs another live process is paying for are waited for, not bought.
  Right before each request (retries included) the claims are renewed: a process paused past ``claim_stale_s``
  whose claims were taken over sends nothing for them and waits for the other process's answers.
- Every paid completion is one ledger row, committed with its answers at once; :meth:`usage` is this run's share.
  A reply without ``usage`` is counted by an upper bound (the prompt's UTF-8 bytes, plus 4 per chat message;
  ``max_tokens``, or the answer's bytes without one), for the ledger and the budget alike, with one warning.
- A cache that cannot be written (a full disk) loses no paid answer: it is kept in memory and in the results, no
  further request is sent, and storing it is retried for ``cache_flush_wait_s``; only if that fails too does the
  call end with one line saying how many paid answers a later run will pay again.
- The key never leaves the client: error texts and answers are stripped of it (and of a base URL's
  credentials) before they reach an annotation, the cache, a log line or an exception.

Identical outputs are ties without a request.

Replicate k > 0 (``annotate(pairs, replicate=k)``) is an independent annotation of the same pairs: its cache key
carries k (so it is requested and paid for once, separately from replicate 0) and its requests carry a sampling
``seed`` drawn from k, the batch's keys and the attempt (derived from ``decoding.seed`` when one is set), so an
endpoint that honours seeds samples afresh and reproducibly. Replicate 0 sends exactly the configured decoding.
A greedy judge (temperature 0) gives every replicate the same answer, as it should.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.annotation_cache import AnnotationCache, CacheError, LedgerTotals, pair_key
from alpacafarm.errors import UserError, public_url, redact
from alpacafarm.seeding import stable_seed
from alpacafarm.types import Annotation, Pair
from alpacafarm_annotators import parsing, templates
from alpacafarm_annotators.config import Price, PromptedAnnotatorConfig
from alpacafarm_annotators.requests import (
    Budget,
    BudgetExceeded,
    Completion,
    RateLimiter,
    RequestFailed,
    complete,
)

PRICES_FILE = Path(__file__).parent / "prices.yaml"
OPENAI_URL = "https://api.openai.com/v1"
logger = logging.getLogger("alpacafarm.annotators")


@cache
def price_table() -> dict[str, Price]:
    return {name: Price(**value) for name, value in yaml.safe_load(PRICES_FILE.read_text()).items()}


def _copy(annotation: Annotation, **changes: Any) -> Annotation:
    """An independent copy (a pool flips the labels it gets in place)."""
    return dataclasses.replace(annotation, metadata=dict(annotation.metadata), **changes)


class PromptedAnnotator(Annotator):
    """One simulated annotator: a model, a prompt template, a batch size, decoding settings and a parser."""

    def __init__(self, config: PromptedAnnotatorConfig, name: str = "prompted", *, cache: AnnotationCache | None = None,
                 budget: Budget | None = None) -> None:
        self.config = config
        self.name = name
        self.model = config.model_map.get(config.model, config.model)
        self._init_prompting()
        self.price = config.price or price_table().get(self.model)
        self.cache = (cache or AnnotationCache()) if config.cache else None
        self.budget = budget or Budget(config.max_cost_usd)
        self.run_id = uuid.uuid4().hex  # this annotator's rows in the ledger (its run)
        self._usage = LedgerTotals(0, 0, 0, 0.0)
        self.no_usage = False  # an answer came without ``usage``: tokens are counted here (warned once)
        if self.budget.max_cost_usd is not None and self.price is None:
            raise UserError(f"annotator {name!r}: max_cost_usd needs a price for model {self.model!r}; set 'price'")

    # ------------------------------------------------------------------ prompting (subclasses may change it)
    def _init_prompting(self) -> None:
        """Load the template and check the parser (the built-in templates/ and parsing.PARSERS)."""
        try:
            self.template = templates.load_template(self.config.template)
        except ValueError as exc:  # a name or path given with --set template=... or in a recipe
            raise UserError(f"annotator {self.name!r}: {exc}") from None
        if self.config.parser not in parsing.PARSERS:
            raise UserError(f"annotator {self.name!r}: unknown parser {self.config.parser!r} "
                            f"(known: {', '.join(parsing.PARSERS)})")

    def render(self, pairs: Sequence[Pair]) -> Any:
        """The prompt of one request for ``pairs``: chat messages or one completion string."""
        return templates.render(self.template, pairs, self.config.style)

    def parse(self, completion: Completion, n: int) -> list[Any] | None:
        """One preference per pair from a completion, or None when it cannot be read (never guessed)."""
        return parsing.parse(self.config.parser, completion.text, n)

    def fingerprint_payload(self) -> dict[str, Any]:
        """Everything that determines a label (not the endpoint or key)."""
        return {"model": self.model, "template": templates.template_text(self.template), "style": self.config.style,
                "batch_size": self.config.batch_size, "decoding": self.config.decoding, "parser": self.config.parser,
                "logprobs": self.config.logprobs}

    def describe(self) -> dict[str, Any]:
        """What this judge is, for ``annotate --describe``: model, template and where it comes from, parser."""
        source = (self.config.template if self.config.template.endswith((".yaml", ".yml"))
                  else f"alpacafarm built-in: plugins/alpacafarm_annotators/templates/{self.config.template}.yaml")
        return {"name": self.name, "model": self.model, "endpoint": f"{self.config.style} ({self.endpoint})",
                "batch_size": self.config.batch_size, "template": source, "parser": self.config.parser,
                "decoding": dict(self.config.decoding)}

    # ------------------------------------------------------------------ identity, cost
    @property
    def fingerprint(self) -> str:
        """What determines a label: model, template, style, batch size, decoding, parser (not the endpoint or key)."""
        return hashlib.sha256(json.dumps(self.fingerprint_payload(), sort_keys=True).encode()).hexdigest()

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        if self.price is None:
            return 0.0
        return (tokens_in * self.price.input + tokens_out * self.price.output) / 1e6

    def _estimate(self, prompt: Any) -> float:
        """What one request may cost at most, reserved against ``max_cost_usd`` while it is in flight: the upper
        bound of :meth:`counted_tokens` (so the ledger stays within the budget whether or not the server reports
        usage; 512 answer tokens when ``max_tokens`` is not set)."""
        tokens_in, _ = self.counted_tokens(prompt, "")
        return self.cost(tokens_in, self._max_tokens() or 512)

    def _max_tokens(self) -> int | None:
        value = self.config.decoding.get("max_completion_tokens") or self.config.decoding.get("max_tokens")
        return int(value) if value else None

    def counted_tokens(self, prompt: Any, answer: str) -> tuple[int, int]:
        """(tokens in, tokens out) of a reply that reported no usage, as an upper bound: a byte-level tokenizer
        makes at most one token per UTF-8 byte (plus a few per chat message); the answer costs at most
        ``max_tokens`` (hidden reasoning included), or its own bytes when no limit is set."""
        if isinstance(prompt, str):
            tokens_in = len(prompt.encode("utf-8"))
        else:
            tokens_in = sum(len(str(m.get("content") or "").encode("utf-8")) + 4 for m in prompt) + 3
        return tokens_in, self._max_tokens() or len(answer.encode("utf-8"))

    def secrets(self) -> list[str]:
        """What must never be written: the key, and the credentials and query values of the base URL."""
        from urllib.parse import parse_qsl, urlsplit

        found = []
        key_env = self.config.api_key_env
        if key_env and os.environ.get(key_env):
            found.append(os.environ[key_env])
        url = self.config.base_url or os.environ.get("OPENAI_BASE_URL") or ""
        try:
            parts = urlsplit(url)
            found += [p for p in (parts.username, parts.password) if p]
            found += [v for _, v in parse_qsl(parts.query) if v]
        except ValueError:
            pass
        return [s for s in found if len(s) >= 4]

    def _make_client(self) -> Any:
        """A client for one ``aannotate`` call (async clients belong to one event loop). The key is read from the
        environment here and lives only inside the client."""
        import openai

        base_url = self.config.base_url or os.environ.get("OPENAI_BASE_URL")
        key_env = self.config.api_key_env
        api_key = os.environ.get(key_env) if key_env else None
        if not api_key:
            if base_url is None:
                raise UserError(f"annotator {self.name!r} calls the OpenAI API: set ${key_env or 'OPENAI_API_KEY'} "
                                "or point base_url at your own OpenAI-compatible server")
            api_key = "not-needed"  # local servers accept any key
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.config.timeout_s)

    @property
    def endpoint(self) -> str:
        """The base URL requests go to, safe to print: never the key (credentials and a query are cut off)."""
        return public_url(self.config.base_url or os.environ.get("OPENAI_BASE_URL") or OPENAI_URL)

    def usage(self) -> LedgerTotals:
        return dataclasses.replace(self._usage)

    def _failed(self, error: str) -> Annotation:
        return Annotation(None, self.name, outcome="failed",
                          metadata={"error": redact(error, self.secrets()), "endpoint": self.endpoint})

    # ------------------------------------------------------------------ annotate
    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        results: list[Annotation | None] = [None] * len(pairs)
        keys = [pair_key(self.fingerprint, p, replicate) for p in pairs]
        todo: list[int] = []
        first: dict[str, int] = {}  # a pair given twice is requested once; the repeat gets a copy of its answer
        repeats: list[tuple[int, int]] = []
        cached = self.cache.get_many(keys, self.config.reask_unparsed) if self.cache else {}
        for i, pair in enumerate(pairs):
            hit = cached.get(keys[i])
            results[i] = identical_tie(pair, self.name) or (_copy(hit) if hit else None)  # callers may mutate
            if results[i] is None:
                if keys[i] in first:
                    repeats.append((i, first[keys[i]]))
                else:
                    first[keys[i]] = i
                    todo.append(i)
        if progress and len(pairs) - len(todo) - len(repeats):
            progress(len(pairs) - len(todo) - len(repeats), 0.0)
        if todo:
            await _Call(self, pairs, keys, results, progress, replicate).run(todo)
        for i, j in repeats:  # not paid again: served like a cached answer (a failure stays a failure)
            original = results[j]
            results[i] = _copy(original, cached=original.outcome != "failed") if original is not None else None
        if progress and repeats:
            progress(len(repeats), 0.0)
        return [r if r is not None else self._failed("no answer") for r in results]

    def decoding(self, replicate: int = 0, attempt: int = 0, keys: Sequence[str] = ()) -> dict[str, Any]:
        """The decoding parameters of one request: the config's for replicate 0; for replicate k > 0 the same with a
        ``seed`` drawn from (``decoding.seed``, k, the batch's cache keys, attempt)."""
        if not replicate:
            return self.config.decoding
        base = self.config.decoding.get("seed")
        return {**self.config.decoding, "seed": stable_seed(base, "replicate", replicate, attempt, *keys)}

    def record(self, completion: Completion, keys: list[str], entries: list[tuple[str, Annotation]], parsed: bool,
               owner: str | None) -> dict[str, Any] | None:
        """Book one paid completion: the run's usage, and the cache's ledger with its answers (one transaction).
        Returns None, or, when the cache could not store it (raising :class:`CacheError`), the arguments of
        ``record_batch`` for a later try (``CacheError`` is then in ``["error"]``)."""
        price = self.cost(completion.tokens_in, completion.tokens_out)
        self._usage.add(completion.tokens_in, completion.tokens_out, price)
        if self.cache is None:
            return None
        booking = {"annotator": self.name, "model": self.model, "entries": entries, "tokens_in": completion.tokens_in,
                   "tokens_out": completion.tokens_out, "price_usd": price, "latency_s": completion.latency_s,
                   "attempts": completion.attempts, "parsed": parsed, "keys": keys, "run": self.run_id,
                   "owner": owner}
        try:
            self.cache.record_batch(**booking)
        except CacheError as exc:
            return {**booking, "error": exc}
        return None


class ClaimLost(Exception):
    """Raised right before a request: some of its pairs are no longer this call's to pay for (``lost``:
    key -> "answered" or the process that took them over while this one was paused)."""

    def __init__(self, lost: dict[str, str]) -> None:
        super().__init__(f"{len(lost)} claim(s) lost")
        self.lost = lost


class _Call:
    """One ``aannotate`` call's requests: claims, batches, pair-by-pair re-asks, waiting for other processes, and a
    circuit breaker (an endpoint that failed every request so far, or three in a row, gets no more requests)."""

    def __init__(self, judge: PromptedAnnotator, pairs: Sequence[Pair], keys: list[str],
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
            if not completion.usage_reported:
                completion.tokens_in, completion.tokens_out = judge.counted_tokens(prompt, completion.text)
                if not judge.no_usage:
                    judge.no_usage = True
                    logger.warning("%s: %s sent no token usage: tokens are counted here as an upper bound (prompt "
                                   "bytes, max_tokens) for the ledger and max_cost_usd", judge.name, judge.endpoint)
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
