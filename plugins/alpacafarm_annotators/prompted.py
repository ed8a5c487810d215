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

``mode: batch`` sends the same requests as batch files (``/v1/files`` + ``/v1/batches``) at the batch rate, each
batch recorded in the cache before it is uploaded, so that it is resumed, never re-sent (see
:mod:`alpacafarm_annotators.batch_call`).

Replicate k > 0 (``annotate(pairs, replicate=k)``) is an independent annotation of the same pairs: its cache key
carries k (so it is requested and paid for once, separately from replicate 0) and its requests carry a sampling
``seed`` drawn from k, the batch's keys and the attempt (derived from ``decoding.seed`` when one is set), so an
endpoint that honours seeds samples afresh and reproducibly. Replicate 0 sends exactly the configured decoding.
A greedy judge (temperature 0) gives every replicate the same answer, as it should.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.annotation_cache import AnnotationCache, CacheError, LedgerTotals, pair_key
from alpacafarm.errors import UserError, public_url, redact, scrub_tokens
from alpacafarm.seeding import stable_seed
from alpacafarm.types import Annotation, Pair
from alpacafarm_annotators import parsing, templates
from alpacafarm_annotators.annotation_call import AnnotationCall
from alpacafarm_annotators.batch_call import BatchCall
from alpacafarm_annotators.config import Price, PromptedAnnotatorConfig
from alpacafarm_annotators.endpoint_requests import (
    Budget,
    Completion,
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

    accepts_replicate = True  # a replicate has its own cache key and request seed

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
        self.bad_usage = 0  # answers whose ``usage`` was not believable (each named, up to a few)
        if self.budget.max_cost_usd is not None and self.price is None:
            raise UserError(f"annotator {name!r}: max_cost_usd needs a price for model {self.model!r}; set 'price'")
        if config.mode == "batch":
            self._init_batch_mode()

    def _init_batch_mode(self) -> None:
        """``mode: batch``: batches are recorded in the cache (so it is required) and priced at the batch rate."""
        if self.cache is None:
            raise UserError(f"annotator {self.name!r}: mode: batch needs the annotation cache (it records each "
                            "batch so that a re-run collects it instead of paying again); remove cache: false / "
                            "--no-cache")
        if self.price is not None:
            rate = self.price.batch_rate()
            if rate is None:
                raise UserError(f"annotator {self.name!r}: mode: batch needs the batch rate of model {self.model!r}: "
                                "set price.batch_input and price.batch_output (USD per million tokens)")
            self.price = rate

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

    def count_tokens_itself(self, completion: Completion, what: str, *, prompt: Any = None,
                            tokens_in_bound: int | None = None) -> None:
        """Set the tokens of a paid ``completion`` whose provider reported no usage, or numbers that are not
        believable (:mod:`~alpacafarm_annotators.provider_numbers`), to this judge's upper bound: the prompt's
        (:meth:`counted_tokens`; without the prompt, as a batch is collected, ``tokens_in_bound``) and ``max_tokens``.
        The same for the live and the batch path; ``what`` names the pairs (see ``describe_pairs``). The answer is
        kept either way: it was paid for, and it is now priced."""
        if completion.usage_believable:
            return
        if prompt is not None:
            completion.tokens_in, completion.tokens_out = self.counted_tokens(prompt, completion.text)
        else:
            completion.tokens_in = tokens_in_bound or 0
            completion.tokens_out = self._max_tokens() or len(completion.text.encode("utf-8"))
        bound = "prompt bytes, max_tokens" if prompt is not None or tokens_in_bound else "max_tokens"
        if completion.usage_problems:
            self.bad_usage += 1
            if self.bad_usage <= 5:  # each named, but a provider that always errs does not flood the log
                problems = scrub_tokens(redact("; ".join(completion.usage_problems), self.secrets()))  # its text
                logger.warning("%s: %s reported %s for %s: not believed; its tokens are counted here as an upper "
                               "bound (%s) for the ledger and max_cost_usd, and the answer is kept%s", self.name,
                               self.endpoint, problems, what, bound,
                               " (further ones are not shown)" if self.bad_usage == 5 else "")
        elif not self.no_usage:
            self.no_usage = True
            logger.warning("%s: %s sent no token usage: tokens are counted here as an upper bound (%s) for the "
                           "ledger and max_cost_usd", self.name, self.endpoint, bound)

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
            call = BatchCall if self.config.mode == "batch" else AnnotationCall
            await call(self, pairs, keys, results, progress, replicate).run(todo)
        for i, j in repeats:  # not paid again: served like a cached answer (a failure stays a failure)
            original = results[j]
            results[i] = _copy(original, cached=original.outcome != "failed") if original is not None else None
        if progress and repeats:
            progress(len(repeats), 0.0)
        return [r if r is not None else self._failed("no answer") for r in results]

    async def acancel_batches(self, which: str = "all") -> list[dict[str, Any]]:
        """Cancel this annotator's open batches (``which``: ``all`` or a batch id) and book what they answered."""
        from alpacafarm_annotators import batch_maintenance

        if self.cache is None:
            return []
        return await batch_maintenance.cancel(BatchCall(self, [], [], [], None, 0), which)

    async def aforget_batch(self, which: str) -> list[dict[str, Any]]:
        """Release the pairs of this annotator's pending batch ``which`` that its provider no longer knows
        (``--batch-forget``; see :mod:`~alpacafarm_annotators.batch_maintenance`): nothing is booked."""
        from alpacafarm_annotators import batch_maintenance

        if self.cache is None:
            return []
        return await batch_maintenance.forget(BatchCall(self, [], [], [], None, 0), which)

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
