"""An LLM judge behind any OpenAI-compatible endpoint (OpenAI, vLLM, llama.cpp server, Ollama, TGI, ...).

Pairs are grouped into batches of ``batch_size`` per request, rendered with the annotator's prompt template and
read back with its parser. A batch whose answers cannot be read (wrong count, garbage) is requested once more;
if that also fails its pairs are marked unparsed (``None``), never guessed. Identical outputs are ties without a
request. Every answered request is committed to the cache and ledger at once.

Replicate k > 0 (``annotate(pairs, replicate=k)``) is an independent annotation of the same pairs: its cache key
carries k (so it is requested and paid for once, separately from replicate 0) and its requests carry a sampling
``seed`` drawn from k, the batch's keys and the attempt (derived from ``decoding.seed`` when one is set), so an
endpoint that honours seeds samples afresh and reproducibly. Replicate 0 sends exactly the configured decoding.
A greedy judge (temperature 0) gives every replicate the same answer, as it should.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.annotation_cache import AnnotationCache, pair_key
from alpacafarm.errors import UserError
from alpacafarm.seeding import stable_seed
from alpacafarm.types import Annotation, Pair
from alpacafarm_annotators import parsing, templates
from alpacafarm_annotators.config import Price, PromptedAnnotatorConfig
from alpacafarm_annotators.requests import Budget, Completion, RateLimiter, RequestFailed, complete

PRICES_FILE = Path(__file__).parent / "prices.yaml"


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
        self.template = templates.load_template(config.template)
        if config.parser not in parsing.PARSERS:
            raise UserError(f"annotator {name!r}: unknown parser {config.parser!r} "
                            f"(known: {', '.join(parsing.PARSERS)})")
        self.price = config.price or price_table().get(self.model)
        self.cache = (cache or AnnotationCache()) if config.cache else None
        self.budget = budget or Budget(config.max_cost_usd)
        if self.budget.max_cost_usd is not None and self.price is None:
            raise UserError(f"annotator {name!r}: max_cost_usd needs a price for model {self.model!r}; set 'price'")

    # ------------------------------------------------------------------ identity, cost
    @property
    def fingerprint(self) -> str:
        """What determines a label: model, template, style, batch size, decoding, parser (not the endpoint or key)."""
        payload = {"model": self.model, "template": templates.template_text(self.template), "style": self.config.style,
                   "batch_size": self.config.batch_size, "decoding": self.config.decoding, "parser": self.config.parser,
                   "logprobs": self.config.logprobs}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        if self.price is None:
            return 0.0
        return (tokens_in * self.price.input + tokens_out * self.price.output) / 1e6

    def _estimate(self, prompt: Any) -> float:
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        return self.cost(len(text) // 3 + 16, int(self.config.decoding.get("max_tokens", 512)))

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

    # ------------------------------------------------------------------ annotate
    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        results: list[Annotation | None] = [None] * len(pairs)
        keys = [pair_key(self.fingerprint, p, replicate) for p in pairs]
        todo: list[int] = []
        first: dict[str, int] = {}  # a pair given twice is requested once; the repeat gets a copy of its label
        repeats: list[tuple[int, int]] = []
        cached = self.cache.get_many(keys) if self.cache else {}
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

        if not todo:
            return [r for r in results if r is not None]
        client = self._make_client()
        batches = [todo[s:s + self.config.batch_size] for s in range(0, len(todo), self.config.batch_size)]
        semaphore = asyncio.Semaphore(self.config.max_concurrency)
        limiter = RateLimiter(self.config.requests_per_minute)
        budget_error: list[Exception] = []

        async def run_batch(indices: list[int]) -> None:
            async with semaphore:
                if budget_error:
                    return
                try:
                    annotations = await self._annotate_batch(client, [pairs[i] for i in indices],
                                                             [keys[i] for i in indices], limiter, replicate)
                except UserError as exc:  # budget or a refused request: stop scheduling, keep what is done
                    budget_error.append(exc)
                    return
                for i, annotation in zip(indices, annotations, strict=True):
                    results[i] = annotation
                if progress:
                    progress(len(indices), sum(a.price_usd for a in annotations))

        try:
            await asyncio.gather(*(run_batch(b) for b in batches))
        finally:
            await client.close()
        if budget_error:
            done = sum(r is not None for r in results)
            raise type(budget_error[0])(f"{budget_error[0]} ({done}/{len(pairs)} pairs annotated)")
        for i, j in repeats:  # not paid again: served like a cached label
            original = results[j]
            results[i] = _copy(original, cached=True) if original is not None else None
        if progress and repeats:
            progress(len(repeats), 0.0)
        return [r if r is not None else Annotation(None, self.name) for r in results]

    def decoding(self, replicate: int = 0, attempt: int = 0, keys: Sequence[str] = ()) -> dict[str, Any]:
        """The decoding parameters of one request: the config's for replicate 0; for replicate k > 0 the same with a
        ``seed`` drawn from (``decoding.seed``, k, the batch's cache keys, attempt)."""
        if not replicate:
            return self.config.decoding
        base = self.config.decoding.get("seed")
        return {**self.config.decoding, "seed": stable_seed(base, "replicate", replicate, attempt, *keys)}

    async def _annotate_batch(self, client: Any, batch: list[Pair], keys: list[str],
                              limiter: RateLimiter, replicate: int = 0) -> list[Annotation]:
        prompt = templates.render(self.template, batch, self.config.style)
        total_in = total_out = 0
        latency = 0.0
        attempts = 0
        labels = None
        completion: Completion | None = None
        for attempt in range(2):  # the paper's annotators are asked again once when their answer cannot be read
            estimate = self._estimate(prompt)
            self.budget.reserve(estimate)
            try:
                completion = await complete(
                    client, style=self.config.style, model=self.model, prompt=prompt,
                    decoding=self.decoding(replicate, attempt, keys), logprobs=self.config.logprobs,
                    max_retries=self.config.max_retries,
                    timeout_s=self.config.timeout_s, limiter=limiter, backoff_s=self.config.retry_backoff_s)
            except RequestFailed as exc:
                self.budget.settle(estimate, 0.0)
                return [Annotation(None, self.name, metadata={"error": str(exc)}) for _ in batch]  # not cached
            except BaseException:
                self.budget.settle(estimate, 0.0)
                raise
            self.budget.settle(estimate, self.cost(completion.tokens_in, completion.tokens_out))
            total_in += completion.tokens_in
            total_out += completion.tokens_out
            latency += completion.latency_s
            attempts += completion.attempts
            labels = parsing.parse(self.config.parser, completion.text, len(batch))
            if labels is not None:
                break
        assert completion is not None
        n = len(batch)
        price = self.cost(total_in, total_out)
        annotations = [
            Annotation(label, self.name, completion.text, total_in // n, total_out // n, price / n, latency / n,
                       metadata={} if labels is not None else {"error": "unparsed"})
            for label in (labels or [None] * n)
        ]
        if self.cache is not None:
            self.cache.record_batch(self.name, self.model, zip(keys, annotations, strict=True), tokens_in=total_in,
                                    tokens_out=total_out, price_usd=price, latency_s=latency, attempts=attempts,
                                    parsed=labels is not None)
        return annotations
