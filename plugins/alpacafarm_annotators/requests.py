"""Sending requests to an OpenAI-compatible endpoint: bounded concurrency, a rate limit, retries, a budget.

Retries use exponential backoff with jitter and honour ``Retry-After``; they cover 429, 5xx, timeouts,
dropped connections and unreadable bodies. Other 4xx errors (bad key, unknown model) fail at once. A connection
that cannot even be opened (nothing listens at the endpoint: a wrong port, a server that is down) is retried at
most ``connect_retries`` times, so a wrong ``base_url`` fails in seconds instead of backing off for a minute.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from alpacafarm.errors import UserError

logger = logging.getLogger("alpacafarm.annotators")


class BudgetExceeded(UserError):
    """The next request would take the run past ``max_cost_usd``."""


class RequestFailed(Exception):
    """A request that still failed after all retries (its pairs stay unannotated and are not cached)."""


@dataclass
class Completion:
    text: str
    tokens_in: int
    tokens_out: int
    latency_s: float
    attempts: int
    logprobs: Any = None


class RateLimiter:
    """At most ``per_minute`` request starts per minute, spaced evenly."""

    def __init__(self, per_minute: float | None) -> None:
        self.interval = 60.0 / per_minute if per_minute else 0.0
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._lock:
            now = time.monotonic()
            delay = self._next - now
            self._next = max(now, self._next) + self.interval
        if delay > 0:
            await asyncio.sleep(delay)


class Budget:
    """Tracks money spent and reserved by in-flight requests; refuses a request that could exceed the cap."""

    def __init__(self, max_cost_usd: float | None) -> None:
        self.max_cost_usd = max_cost_usd
        self.spent = 0.0
        self.reserved = 0.0

    def reserve(self, estimate: float) -> None:
        if self.max_cost_usd is not None and self.spent + self.reserved + estimate > self.max_cost_usd:
            raise BudgetExceeded(
                f"stopping before the budget is exceeded: max_cost_usd={self.max_cost_usd:.4f}, spent "
                f"${self.spent:.4f}, in flight ${self.reserved:.4f}, next request up to ${estimate:.4f}; "
                f"what was annotated is cached — raise max_cost_usd to continue")
        self.reserved += estimate

    def settle(self, estimate: float, actual: float) -> None:
        self.reserved -= estimate
        self.spent += actual


def _retry_after(exc: Exception) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    value = headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _is_retryable(exc: Exception) -> bool:
    import openai

    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError, openai.APIResponseValidationError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return isinstance(exc, (ValueError, asyncio.TimeoutError))  # an unreadable 200 body surfaces as ValueError


def _cannot_connect(exc: Exception) -> bool:
    """A connection that was never opened (refused, no route, unknown host), as opposed to one dropped mid-way."""
    cause = exc.__cause__
    return cause is not None and any(k.__name__ == "ConnectError" for k in type(cause).__mro__)


async def complete(client: Any, *, style: str, model: str, prompt: Any, decoding: dict[str, Any], logprobs: bool,
                   max_retries: int, timeout_s: float, limiter: RateLimiter, backoff_s: float = 1.0,
                   max_backoff_s: float = 60.0, connect_retries: int | None = None) -> Completion:
    """One completion with retries. Raises :class:`RequestFailed` when retries are exhausted (``connect_retries``
    bounds the retries of a connection that cannot be opened; default: ``max_retries``)."""
    import openai

    attempts = 0
    while True:
        attempts += 1
        await limiter.wait()
        started = time.perf_counter()
        try:
            if style == "chat":
                extra = {"logprobs": True, "top_logprobs": 5} if logprobs else {}
                response = await client.chat.completions.create(model=model, messages=prompt, timeout=timeout_s,
                                                                 **decoding, **extra)
                choice = response.choices[0]
                text = choice.message.content or ""
                choice_logprobs = getattr(choice, "logprobs", None)
            else:
                extra = {"logprobs": 5} if logprobs else {}
                response = await client.completions.create(model=model, prompt=prompt, timeout=timeout_s, **decoding,
                                                           **extra)
                choice = response.choices[0]
                text = choice.text or ""
                choice_logprobs = getattr(choice, "logprobs", None)
            usage = response.usage
            return Completion(text, getattr(usage, "prompt_tokens", 0) or 0,
                              getattr(usage, "completion_tokens", 0) or 0,
                              time.perf_counter() - started, attempts, choice_logprobs)
        except Exception as exc:
            if isinstance(exc, openai.APIStatusError) and not _is_retryable(exc):
                raise UserError(f"the endpoint refused the request ({exc.status_code}): {_short(exc)}") from None
            if not _is_retryable(exc) and not isinstance(exc, openai.OpenAIError):
                raise
            limit = max_retries
            if connect_retries is not None and _cannot_connect(exc):
                limit = min(max_retries, connect_retries)
            if attempts > limit:
                raise RequestFailed(f"{type(exc).__name__} after {attempts} attempts: {_short(exc)}") from None
            delay = _retry_after(exc)
            if delay is None:
                delay = min(max_backoff_s, backoff_s * 2 ** (attempts - 1)) * (0.5 + random.random())
            logger.warning("request failed (%s), retry %d/%d in %.2fs", type(exc).__name__, attempts, limit, delay)
            await asyncio.sleep(delay)


def _short(exc: Exception) -> str:
    return (str(exc).splitlines() or [""])[0][:200]
