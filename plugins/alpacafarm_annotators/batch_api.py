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
from dataclasses import dataclass
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
    """What a finished batch says about one request: a completion body, or why there is none."""

    body: dict[str, Any] | None
    error: str | None


def completion_of(style: str, body: dict[str, Any], secrets: Sequence[str]) -> Completion:
    """A :class:`Completion` from a batch output line's response body (latency is the caller's to set). Raises
    ``ValueError`` for a body without choices."""
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise ValueError("the batch answered with no choices")
    choice = choices[0]
    text = ((choice.get("message") or {}).get("content") if style == "chat" else choice.get("text")) or ""
    usage = body.get("usage")
    usage = usage if isinstance(usage, dict) else None
    return Completion(redact(str(text), secrets), int((usage or {}).get("prompt_tokens") or 0),
                      int((usage or {}).get("completion_tokens") or 0), 0.0, 1, choice.get("logprobs"),
                      usage_reported=usage is not None, finish_reason=choice.get("finish_reason"))


class BatchAPI:
    """The batch operations on one async ``openai`` client, with the annotator's retry settings."""

    def __init__(self, client: Any, *, endpoint: str, max_retries: int, backoff_s: float, max_backoff_s: float,
                 timeout_s: float, secrets: Sequence[str]) -> None:
        self.client, self.endpoint = client, endpoint
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.timeout_s, self.secrets = timeout_s, list(secrets)

    async def _call(self, what: str, make: Callable[[], Awaitable[T]], retries: int | None = None) -> T:
        """``await make()`` with retries (``retries``, default ``max_retries``); a refusal (4xx) is a one-line
        :class:`UserError`, retries exhausted a :class:`RequestFailed`."""
        import openai

        limit = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            attempt += 1
            try:
                return await asyncio.wait_for(make(), self.timeout_s)
            except Exception as exc:
                if isinstance(exc, openai.APIStatusError) and not is_retryable(exc):
                    raise UserError(f"{self.endpoint}: the batch endpoint refused to {what} ({exc.status_code}): "
                                    f"{short_error(exc, self.secrets)}") from None
                if not is_retryable(exc) and not isinstance(exc, openai.OpenAIError):
                    raise
                if attempt > limit:
                    detail = short_error(exc, self.secrets) or f"no answer within timeout_s={self.timeout_s:g}s"
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
        return await self._call(f"poll batch {remote_id}", lambda: self.client.batches.retrieve(remote_id))

    async def cancel(self, remote_id: str) -> Any:
        return await self._call(f"cancel batch {remote_id}", lambda: self.client.batches.cancel(remote_id))

    async def results(self, batch: Any) -> dict[str, LineResult]:
        """The output and error files of a finished batch, by ``custom_id`` (a request in neither has no result)."""
        found: dict[str, LineResult] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            content = await self._call(f"download {file_id}", lambda f=file_id: self.client.files.content(f))
            for number, line in enumerate(content.text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    custom_id = str(row["custom_id"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("%s: line %d of %s is not a batch result; ignored", self.endpoint, number, file_id)
                    continue
                found[custom_id] = _line_result(row, self.secrets)
        return found


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
