"""The batch endpoints of an OpenAI-compatible API (``/v1/files`` + ``/v1/batches``) through the official ``openai``
client: upload a JSONL file of requests, create the batch, look it up, poll it, download its output and error files,
cancel it. Every call is retried like a live request (429, 5xx, timeouts, dropped connections; ``Retry-After``
honoured) and fails with one line naming the endpoint otherwise; error texts never carry the key.

A batch file's line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``, its body
the very dict a live request sends (:func:`~alpacafarm_annotators.endpoint_requests.request_body`); an output line is
``{"custom_id", "response": {"status_code", "body"}, "error"}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from alpacafarm.errors import UserError, redact
from alpacafarm_annotators.endpoint_requests import (
    Completion,
    RequestFailed,
    create_completion,
    is_retryable,
    retry_after_s,
    short_error,
)
from alpacafarm_annotators.provider_numbers import read_usage

logger = logging.getLogger("alpacafarm.annotators")
T = TypeVar("T")

#: The provider's statuses after which a batch changes no more.
TERMINAL = ("completed", "failed", "expired", "cancelled")
#: The ``metadata`` key carrying the local id of a batch (how a killed submitter's batch is found again).
METADATA_KEY = "alpacafarm_batch"


def compact(value: Any) -> str:
    """JSON without spaces, UTF-8 text unescaped (as the ``openai`` client writes request bodies)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class BodyCapture:
    """The exact bytes the live path would send for a request, captured from the ``openai`` client itself (the
    same :func:`~alpacafarm_annotators.endpoint_requests.create_completion` call, on a transport that keeps the request
    instead of sending it): a batch line's body is byte for byte the live request's, whatever key order or
    encoding the installed client uses."""

    def __init__(self) -> None:
        import importlib

        import openai

        base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
        http = importlib.import_module(base.__module__.split(".")[0])  # the HTTP library the client is built on
        self.captured: list[bytes] = []

        def keep(request: Any) -> Any:
            self.captured.append(request.read())
            chat = request.url.path.endswith("/chat/completions")
            choice = ({"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"} if chat
                      else {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None})
            return http.Response(200, json={"id": "captured", "object": "chat.completion" if chat
                                            else "text_completion", "created": 0, "model": "m", "choices": [choice]})

        self.client = openai.AsyncOpenAI(api_key="captured", base_url="http://capture.invalid/v1", max_retries=0,
                                         http_client=openai.DefaultAsyncHttpxClient(transport=http.MockTransport(keep)))

    async def body(self, style: str, model: str, prompt: Any, decoding: dict[str, Any], logprobs: bool,
                   timeout_s: float) -> bytes:
        await create_completion(self.client, style, model, prompt, decoding, logprobs, timeout_s)
        return self.captured.pop()

    async def close(self) -> None:
        await self.client.close()


def body_sha256(body: bytes) -> str:
    """The hash of a request body's bytes (as the batch line and the live request carry them)."""
    return hashlib.sha256(body).hexdigest()


def line_bytes(custom_id: str, url: str, body: bytes) -> bytes:
    """One batch file line around a body's exact bytes."""
    head = compact({"custom_id": custom_id, "method": "POST", "url": url})
    return head[:-1].encode("utf-8") + b',"body":' + body + b"}\n"


@dataclass
class LineResult:
    """What a finished batch says about one request (its ``custom_id``): a completion body, or why there is none.

    A provider may list a ``custom_id`` more than once (a bug, but one that costs money): an answer beats an error
    for it (the answer was billed; re-sending it would buy it again), further answers are in ``extra`` (billed
    too, so booked), and answers that disagree with each other leave ``body`` None with ``conflict`` saying so."""

    body: dict[str, Any] | None
    error: str | None
    extra: list[dict[str, Any]] = field(default_factory=list)
    conflict: str | None = None

    @property
    def answers(self) -> list[dict[str, Any]]:
        """Every answered body the provider returned for this request (each one billed)."""
        return ([self.body] if self.body is not None else []) + self.extra


class BatchUnknown(UserError):
    """The provider answered 404 for a batch or one of its files: it no longer knows it (deleted, another
    account, another provider behind the same URL)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def completion_of(style: str, body: dict[str, Any], secrets: Sequence[str]) -> Completion:
    """A :class:`Completion` from a batch output line's response body (latency is the caller's to set); its usage
    checked as the live path checks it (:func:`~alpacafarm_annotators.provider_numbers.read_usage`). Raises
    ``ValueError`` for a body without choices."""
    choices = body.get("choices") or []
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the batch answered with no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    text = (message.get("content") if style == "chat" else choice.get("text")) or ""
    usage = read_usage(body.get("usage"))
    return Completion(redact(str(text), secrets), usage.tokens_in, usage.tokens_out, 0.0, 1, choice.get("logprobs"),
                      usage_reported=usage.reported, finish_reason=choice.get("finish_reason"),
                      usage_problems=usage.problems)


class BatchAPI:
    """The batch operations on one async ``openai`` client, with the annotator's retry settings."""

    def __init__(self, client: Any, *, endpoint: str, max_retries: int, backoff_s: float, max_backoff_s: float,
                 timeout_s: float, secrets: Sequence[str]) -> None:
        self.client, self.endpoint = client, endpoint
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.timeout_s, self.secrets = timeout_s, list(secrets)

    async def _call(self, what: str, make: Callable[[], Awaitable[T]], retries: int | None = None,
                    about: Sequence[str] = ()) -> T:
        """``await make()`` with retries (``retries``, default ``max_retries``); a refusal (4xx) is a one-line
        :class:`UserError` (a 404 about the batch or file ids in ``about``: :class:`BatchUnknown`; those ids are
        shown whole), retries exhausted a :class:`RequestFailed`."""
        import openai

        limit = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            attempt += 1
            try:
                return await asyncio.wait_for(make(), self.timeout_s)
            except Exception as exc:
                if isinstance(exc, openai.APIStatusError) and not is_retryable(exc):
                    detail = short_error(exc, self.secrets, keep=about)
                    message = f"{self.endpoint}: the batch endpoint refused to {what} ({exc.status_code}): {detail}"
                    if exc.status_code == 404 and about:
                        raise BatchUnknown(message, f"HTTP 404 for {what}: {detail}") from None
                    raise UserError(message) from None
                if not is_retryable(exc) and not isinstance(exc, openai.OpenAIError):
                    raise
                if attempt > limit:
                    detail = (short_error(exc, self.secrets, keep=about)
                              or f"no answer within timeout_s={self.timeout_s:g}s")
                    raise RequestFailed(f"could not {what} at {self.endpoint} after {attempt} attempts: "
                                        f"{type(exc).__name__}: {detail}") from None
                delay = retry_after_s(exc, self.max_backoff_s)
                if delay is None:
                    delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random())
                logger.warning("batch endpoint: could not %s (%s), retry %d/%d in %.2fs", what, type(exc).__name__,
                               attempt, limit, delay)
                await asyncio.sleep(delay)

    async def upload(self, local_id: str, data: bytes) -> str:
        """Upload ``data`` (the JSONL batch file); its file id."""
        uploaded = await self._call("upload the batch file", lambda: self.client.files.create(
            file=(f"alpacafarm-{local_id}.jsonl", data, "application/jsonl"), purpose="batch"))
        return uploaded.id

    async def create(self, local_id: str, file_id: str, *, url: str, window: str, since: float) -> Any | None:
        """Create the batch of an uploaded file, its ``metadata`` naming ``local_id``. Never twice: a create that got
        no answer may have created the batch, so before each retry the batch is looked up (:meth:`find`) and
        returned when it exists. None when every try failed and the provider has no such batch."""
        for attempt in range(1 + self.max_retries):
            try:
                return await self._call("create the batch", lambda: self.client.batches.create(
                    input_file_id=file_id, endpoint=url, completion_window=window,
                    metadata={METADATA_KEY: local_id}), retries=0)
            except RequestFailed as exc:
                logger.warning("%s; looking the batch up before trying again", exc)
                found = await self.find(local_id, since)
                if found is not None:
                    return found
                await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** attempt))
        return None

    async def find(self, local_id: str, since: float) -> Any | None:
        """The provider's batch created for ``local_id`` (by its metadata), looking back to ``since`` (UNIX time)."""
        async def search() -> Any | None:
            async for batch in self.client.batches.list(limit=100):
                if (batch.metadata or {}).get(METADATA_KEY) == local_id:
                    return batch
                if batch.created_at is not None and batch.created_at < since - 3600:
                    return None  # newest first: older batches cannot be this one
            return None

        return await self._call("list batches", search)

    async def retrieve(self, remote_id: str) -> Any:
        return await self._call(f"poll batch {remote_id}", lambda: self.client.batches.retrieve(remote_id),
                                about=[remote_id])

    async def cancel(self, remote_id: str) -> Any:
        return await self._call(f"cancel batch {remote_id}", lambda: self.client.batches.cancel(remote_id),
                                about=[remote_id])

    async def results(self, batch: Any) -> dict[str, LineResult]:
        """The output and error files of a finished batch, by ``custom_id`` (a request in neither has no result;
        one listed several times: see :class:`LineResult`)."""
        rows: dict[str, list[LineResult]] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            try:
                content = await self._call(f"download {file_id} of batch {batch.id}",
                                           lambda f=file_id: self.client.files.content(f), about=[file_id, batch.id])
            except BatchUnknown as exc:
                if file_id == batch.output_file_id:
                    raise  # the answers are gone: the batch can never be collected
                logger.warning("%s: %s; its requests count as unanswered (submitted again)", self.endpoint, exc)
                continue
            for number, line in enumerate(content.text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    custom_id = str(row["custom_id"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("%s: line %d of %s is not a batch result; ignored", self.endpoint, number, file_id)
                    continue
                rows.setdefault(custom_id, []).append(_line_result(row, self.secrets))
        return {custom_id: self._merge(batch.id, custom_id, found) for custom_id, found in rows.items()}

    def _merge(self, batch_id: str, custom_id: str, found: list[LineResult]) -> LineResult:
        """One result for a ``custom_id`` the provider listed ``len(found)`` times (see :class:`LineResult`)."""
        if len(found) == 1:
            return found[0]
        answers = [r.body for r in found if r.body is not None]
        where = f"batch {batch_id}: custom_id {custom_id} is listed {len(found)} times"
        if not answers:
            return found[0]
        if len(answers) < len(found):
            logger.warning("%s: %s %s, answered and failed: the answer is kept (it was billed; sending the request "
                           "again would buy it twice)", self.endpoint, where, "in the output and error files")
        if len({_answer_of(a) for a in answers}) > 1:
            conflict = (f"{where} with different answers (choices[0] differs): which one is the judge's cannot be "
                        "told, so none is used; each is booked (billed)")
            logger.warning("%s: %s", self.endpoint, conflict)
            return LineResult(None, None, extra=answers, conflict=conflict)
        if len(answers) > 1:
            logger.warning("%s: %s with the same answer: it is used once; every copy is booked (billed)",
                           self.endpoint, where)
        return LineResult(answers[0], None, extra=answers[1:])


def _answer_of(body: dict[str, Any]) -> str:
    """What identifies an answer (its first choice's text or message), to tell duplicates from conflicts."""
    choices = body.get("choices") if isinstance(body.get("choices"), list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    return json.dumps([first.get("message"), first.get("text")], sort_keys=True, default=str)


def _line_result(row: dict[str, Any], secrets: Sequence[str]) -> LineResult:
    response = row.get("response") if isinstance(row.get("response"), dict) else {}
    error = row.get("error")
    status = response.get("status_code")
    body = response.get("body") if isinstance(response.get("body"), dict) else None
    if not error and status == 200 and body is not None:
        return LineResult(body, None)
    if isinstance(error, dict):
        text = f"{error.get('code') or 'error'}: {error.get('message') or ''}"
    elif body is not None and isinstance(body.get("error"), dict):
        text = f"HTTP {status}: {body['error'].get('message') or ''}"
    else:
        text = f"HTTP {status}" if status else str(error or "no response")
    return LineResult(None, redact(f"the batch returned no answer ({text.strip()})", secrets)[:300])
