"""Sending requests to an OpenAI-compatible endpoint: bounded concurrency, a rate limit, retries, a budget.

Retries use exponential backoff with jitter and honour ``Retry-After`` (capped at ``max_backoff_s``; a value that
is not a finite number of seconds is ignored); they cover 429, 5xx, timeouts, dropped connections and unreadable
bodies (a 200 without choices too). Other 4xx errors (bad key, unknown model) fail at once. A connection that
cannot even be opened (nothing listens at the endpoint: a wrong port, a server that is down) is retried at most
``connect_retries`` times and a request that timed out at most ``timeout_retries`` times, so a wrong ``base_url``
or a stalled endpoint fails in seconds or minutes instead of backing off for ten. ``timeout_s`` is a deadline
for the whole request (connect, headers and body), not for each read: a body trickled byte by byte ends too.

Error texts never carry the key: a provider's error body is summarised (status, error code and type; its message
only outside authentication errors), and what is kept loses the ``secrets`` it is given in every form
:func:`alpacafarm.errors.redact` computes (an endpoint may echo the key reversed, spaced, encoded or masked)
before it reaches an exception, a log line or an output file.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from alpacafarm.errors import UserError, redact, scrub_tokens
from alpacafarm_annotators.provider_numbers import read_usage

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
    #: False when the reply carried no ``usage``: the caller counts the tokens itself (see prompted.py)
    usage_reported: bool = True
    finish_reason: str | None = None
    #: what was wrong with the ``usage`` the reply did carry (see provider_numbers.py): counted by the caller too
    usage_problems: list[str] = field(default_factory=list)

    @property
    def usage_believable(self) -> bool:
        """True when ``tokens_in``/``tokens_out`` are the provider's own, checked counts."""
        return self.usage_reported and not self.usage_problems


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


def retry_after_s(exc: Exception, cap_s: float) -> float | None:
    """The server's ``Retry-After`` in seconds, at most ``cap_s``; None when absent or not a finite number
    (``inf`` or ``nan`` would otherwise sleep forever)."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    value = headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return min(cap_s, max(0.0, seconds)) if math.isfinite(seconds) else None


def is_retryable(exc: Exception) -> bool:
    import openai

    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError, openai.APIResponseValidationError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return isinstance(exc, (ValueError, asyncio.TimeoutError))  # an unreadable 200 body surfaces as ValueError


def _timed_out(exc: Exception) -> bool:
    import openai

    return isinstance(exc, (openai.APITimeoutError, asyncio.TimeoutError, TimeoutError))


def _cannot_connect(exc: Exception) -> bool:
    """A connection that was never opened (refused, no route, unknown host), as opposed to one dropped mid-way."""
    cause = exc.__cause__
    return cause is not None and any(k.__name__ == "ConnectError" for k in type(cause).__mro__)


async def complete(client: Any, *, style: str, model: str, prompt: Any, decoding: dict[str, Any], logprobs: bool,
                   max_retries: int, timeout_s: float, limiter: RateLimiter, backoff_s: float = 1.0,
                   max_backoff_s: float = 60.0, connect_retries: int | None = None,
                   timeout_retries: int | None = None, secrets: Sequence[str] = (),
                   before_send: Callable[[], Awaitable[None]] | None = None,
                   stop: Callable[[], str | None] | None = None) -> Completion:
    """One completion with retries. Raises :class:`RequestFailed` when retries are exhausted (``connect_retries``
    bounds the retries of a connection that cannot be opened, ``timeout_retries`` those of a request that ran
    past ``timeout_s``; default: ``max_retries``).

    ``before_send`` runs (and may raise to cancel) right before every attempt: the caller re-checks there that it
    may still pay (its claims, its cache). ``stop`` is asked before every retry: a text means "give up now" (the
    caller's circuit breaker tripped on another request). ``secrets`` never appear in an error message."""
    import openai

    attempts = timeouts = 0
    while True:
        attempts += 1
        await limiter.wait()
        if before_send is not None:
            await before_send()
        started = time.perf_counter()
        try:
            # The whole request has one deadline: the client's own timeout applies per read, so a body trickled
            # one byte at a time would never end.
            response = await asyncio.wait_for(
                create_completion(client, style, model, prompt, decoding, logprobs, timeout_s), timeout_s)
            if not response.choices:
                raise ValueError("the endpoint answered 200 with no choices")
            choice = response.choices[0]
            text = (choice.message.content if style == "chat" else choice.text) or ""
            usage = read_usage(getattr(response, "usage", None))  # the one check of a provider's counts
            return Completion(redact(text, secrets), usage.tokens_in, usage.tokens_out,
                              time.perf_counter() - started, attempts, getattr(choice, "logprobs", None),
                              usage_reported=usage.reported, finish_reason=getattr(choice, "finish_reason", None),
                              usage_problems=usage.problems)
        except Exception as exc:
            if isinstance(exc, openai.APIStatusError) and not is_retryable(exc):
                raise UserError(f"the endpoint refused the request: {short_error(exc, secrets)}") from None
            if not is_retryable(exc) and not isinstance(exc, openai.OpenAIError):
                raise
            limit = max_retries
            if connect_retries is not None and _cannot_connect(exc):
                limit = min(limit, connect_retries)
            timeouts += _timed_out(exc)
            name = "Timeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            if attempts > limit or (timeout_retries is not None and timeouts > timeout_retries):
                detail = short_error(exc, secrets) or f"no complete answer within timeout_s={timeout_s:g}s"
                raise RequestFailed(f"{name} after {attempts} attempts: {detail}") from None
            halted = stop() if stop is not None else None
            if halted:
                raise RequestFailed(f"{name} after {attempts} attempts, not retried ({halted}): "
                                    f"{short_error(exc, secrets)}") from None
            delay = retry_after_s(exc, max_backoff_s)
            if delay is None:
                delay = min(max_backoff_s, backoff_s * 2 ** (attempts - 1)) * (0.5 + random.random())
            logger.warning("request failed (%s), retry %d/%d in %.2fs", name, attempts, limit, delay)
            await asyncio.sleep(delay)


def request_body(style: str, model: str, prompt: Any, decoding: dict[str, Any], logprobs: bool) -> dict[str, Any]:
    """The JSON body of one annotation request: what a live request sends and what a batch file's line carries
    (the same dict, so both paths send byte-identical bodies)."""
    if style == "chat":
        extra: dict[str, Any] = {"logprobs": True, "top_logprobs": 5} if logprobs else {}
        return {"model": model, "messages": prompt, **decoding, **extra}
    extra = {"logprobs": 5} if logprobs else {}
    return {"model": model, "prompt": prompt, **decoding, **extra}


def endpoint_path(style: str) -> str:
    """The API path of a request of this style (a batch line's ``url``)."""
    return "/v1/chat/completions" if style == "chat" else "/v1/completions"


async def create_completion(client: Any, style: str, model: str, prompt: Any, decoding: dict[str, Any], logprobs: bool,
                  timeout_s: float) -> Any:
    """Send one annotation request with ``client`` (what the live path sends; a batch file's body is captured from
    this very call, see :class:`~alpacafarm_annotators.batch_api.BodyCapture`)."""
    body = request_body(style, model, prompt, decoding, logprobs)
    create = client.chat.completions.create if style == "chat" else client.completions.create
    return await create(**body, timeout=timeout_s)


#: Statuses whose error body is about the credential itself: their message is never kept (it may quote the key in
#: a form no one can compute).
_AUTH_STATUSES = (401, 403, 407)


def short_error(exc: Exception, secrets: Sequence[str] = (), keep: Sequence[str] = ()) -> str:
    """One line about ``exc`` fit for messages, logs and files. A provider's error body is summarised: its status,
    error code and type; the message only when not an authentication error, scrubbed of the key in every form
    :func:`alpacafarm.errors.redact` knows and of anything else key-shaped but the ids in ``keep`` (the batch or
    file the request was about: an id is random-looking, yet the user needs it whole to act on it)."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        error = body.get("error") if isinstance(body.get("error"), dict) else body
        code = " ".join(str(error[k]) for k in ("code", "type") if isinstance(error.get(k), str | int))
        summary = f"HTTP {exc.status_code}" + (f" {_words(code)}" if code else "")
        message = error.get("message")
        if exc.status_code in _AUTH_STATUSES or not isinstance(message, str):
            return summary
        return f"{summary}: {_clean(message, secrets, keep)}"
    return _clean(str(exc), secrets, keep)


def _words(text: str) -> str:
    """An error code as shown: identifier characters only (a code is never free text)."""
    return re.sub(r"[^A-Za-z0-9_. -]", "", text)[:80]


def _clean(text: str, secrets: Sequence[str], keep: Sequence[str] = ()) -> str:
    text = redact(text, secrets)  # the key in every form first: an id that quotes it is not kept whole
    shown = [k for k in keep if k and k not in secrets]
    for i, known in enumerate(shown):  # our own ids are not keys: out of the token scrubber's sight
        text = text.replace(known, f"\x00{i}\x00")
    text = scrub_tokens(text)  # before cutting: a cut key would no longer match
    for i, known in enumerate(shown):
        text = text.replace(f"\x00{i}\x00", known)
    return (text.splitlines() or [""])[0][:200]
