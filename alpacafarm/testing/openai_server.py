"""A real OpenAI-compatible HTTP server on 127.0.0.1 for tests and benchmarks of API annotators.

Standard library only: a ``ThreadingHTTPServer`` (one daemon thread per connection) served from a background
thread, so the real ``openai`` client (sync or async) talks to it over real sockets. Use it when a test or a
benchmark needs an API without a key or the network::

    with FakeOpenAIServer(my_responder, latency_s=0.2) as server:
        client = OpenAI(api_key="sk-test", base_url=server.base_url, max_retries=0)
        server.script(Fault("429", retry_after=1.0), None, Fault("hang", seconds=2))
        ...
        assert server.answered() == 3

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``usage`` and optional
``logprobs``), ``GET /v1/models``; anything else is a 404 in OpenAI's error shape. Real tests usually pass
their own responder; the default, :func:`prefer_first_responder`, answers pairwise-annotation prompts.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

__all__ = ["FakeOpenAIServer", "Fault", "RecordedRequest", "Responder", "echo_forms", "prefer_first_responder",
           "request_text"]


@dataclass
class Fault:
    """What the server does instead of answering normally, for one request.

    ``429``/``500``/``503``: an OpenAI error JSON with that status (``retry_after`` seconds as ``Retry-After``).
    ``hang``: wait ``seconds`` (longer than the client timeout), then answer normally. ``garbage``: HTTP 200
    with a JSON content type and a truncated, unparsable body. ``close``: drop the connection, no response.
    ``wrong_count``: a normal, billed 200 completion whose answer has the wrong number of answers (a judge that
    skipped or invented a pair): the last line of the answer is dropped, or, for a one-line answer, a line
    ``Pair 2: 1`` is added. The answer distorted is ``text`` when given, else the responder's for a scripted
    fault, else :func:`prefer_first_responder`'s (as for ``hang``).

    ``trickle``: a normal 200 completion whose body is sent a few bytes at a time over ``seconds`` (every read
    gets data, so only a whole-request deadline ends it). ``echo_key``: an error (status ``status``, default 500)
    whose message quotes the request's bearer token in the forms ``echo`` names (a proxy that echoes its input).
    ``no_choices``: a billed 200 with ``choices: []``.
    ``null_content``: a billed 200 whose message content is ``null`` (a reasoning model out of ``max_tokens``:
    ``finish_reason: length``). A ``retry_after`` of ``inf`` or ``nan`` is sent as that text.
    """

    kind: Literal["429", "500", "503", "hang", "garbage", "close", "wrong_count", "trickle", "echo_key",
                  "no_choices", "null_content"]
    retry_after: float | None = None
    seconds: float = 30.0
    text: str | None = None
    #: ``echo_key``: the HTTP status, and how the key is quoted: one of :func:`echo_forms`' names, or several
    #: joined by ``+`` (``"reversed+base64"``)
    status: int = 500
    echo: str = "plain"


def echo_forms(key: str) -> dict[str, str]:
    """The ways a careless server or proxy quotes a key back: as is, reversed, spaced out, base64, URL-encoded,
    hex, masked (prefix and suffix around stars)."""
    import base64
    from urllib.parse import quote

    return {"plain": key, "reversed": key[::-1], "spaced": " ".join(key), "base64": base64.b64encode(
        f"Bearer {key}".encode()).decode(), "url": quote(f"{key}/", safe=""), "hex": key.encode().hex(),
        "masked": f"{key[:5]}{'*' * 16}{key[-4:]}"}


Responder = Callable[[dict], str | Fault]


@dataclass
class RecordedRequest:
    """One request the server received; ``status`` is set just before the response is sent (0 = dropped).

    ``completed`` is True when a parsable completion was sent (a ``garbage`` 200 is not one).
    """

    path: str
    body: dict
    headers: dict[str, str]
    status: int | None = None
    completed: bool = False
    time: float = field(default_factory=time.time)
    raw: bytes = b""  # the body's bytes as received


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def request_text(body: dict) -> str:
    """The text a responder usually looks at: the last user message (chat) or the prompt (completions)."""
    if "messages" in body:
        users = [m for m in body["messages"] if m.get("role") == "user"] or body["messages"]
        return _content_text(users[-1].get("content")) if users else ""
    prompt = body.get("prompt", "")
    return "\n".join(p for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else str(prompt)


def prefer_first_responder(body: dict) -> str:
    """Answer ``Pair k: 1`` for k = 1..n, one line each: always prefer the first output.

    n is ``body["metadata"]["n_pairs"]`` if given, else the number of distinct pair numbers in headings such as
    ``## Pair 3`` in :func:`request_text`, else of ``pair 3`` anywhere in it, else 1. A deterministic default
    only: tests that check annotation parsing should pass a responder that knows their template.
    """
    n = (body.get("metadata") or {}).get("n_pairs")
    if n is None:
        text = request_text(body)
        found = set(re.findall(r"(?im)^#+\s*pair\s+(\d+)", text)) or set(re.findall(r"(?i)\bpair\s+(\d+)\b", text))
        n = len(found) or 1
    return "\n".join(f"Pair {k}: 1" for k in range(1, int(n) + 1))


def _tokens(text: str) -> int:
    return math.ceil(len(text) / 4)


def _split_tokens(text: str) -> list[str]:
    return re.findall(r"\s*\w+|\s*[^\w\s]|\s+", text)  # words and digits with their leading space, punctuation


def _alternatives(token: str, k: int) -> list[tuple[str, float]]:
    """``k`` plausible top tokens: the token itself (p = 0.9) first, then digits or made-up variants."""
    core = token.strip()
    others = [d for d in ("1", "2", "0") if d != core] if core.isdigit() else [f"{core}_{i}" for i in range(1, 6)]
    alts = [(token, math.log(0.9))] + [(token.replace(core, o) if core else o, math.log(0.1 / (i + 2)))
                                       for i, o in enumerate(others)]
    return alts[: max(k, 1)]


def _chat_logprobs(text: str, k: int) -> dict:
    def entry(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    return {"content": [{**entry(t, math.log(0.9)), "top_logprobs": [entry(a, lp) for a, lp in _alternatives(t, k)]}
                        for t in _split_tokens(text)], "refusal": None}


def _completion_logprobs(text: str, k: int) -> dict:
    toks = _split_tokens(text)
    offsets = [sum(len(t) for t in toks[:i]) for i in range(len(toks))]
    return {"tokens": toks, "token_logprobs": [math.log(0.9)] * len(toks), "text_offset": offsets,
            "top_logprobs": [dict(_alternatives(t, k)) for t in toks]}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    allow_reuse_address = True
    owner: FakeOpenAIServer
    open_sockets: set[socket.socket]

    def process_request(self, request: Any, client_address: Any) -> None:
        self.open_sockets.add(request)  # so that stop() can end idle keep-alive connections
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.open_sockets.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:  # clients that hang up are expected
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client's connection pool expects
    # Headers and body go out in separate writes; with Nagle's algorithm on, the body waits for the client's
    # delayed ACK (~40 ms) on every keep-alive request, which would dominate latency measurements.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.owner._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.owner._handle(self, "POST")


class FakeOpenAIServer:
    """An OpenAI-compatible server on a free port of 127.0.0.1; ``start()``/``stop()`` or use ``with``.

    ``responder`` gets each request's JSON body and returns the completion text or a :class:`Fault`.
    ``latency_s`` (changeable at any time) delays every response. ``model_prefix`` is prepended to the
    requested model name in responses and names the one model of ``GET /v1/models``.
    """

    def __init__(self, responder: Responder | None = None, *, latency_s: float = 0.0, model_prefix: str = "",
                 enforce_max_tokens: bool = False, usage: bool = True):
        self.responder: Responder = responder or prefer_first_responder
        self.latency_s = latency_s
        self.model_prefix = model_prefix
        #: cut each answer after ``max_tokens`` tokens (words and punctuation) with ``finish_reason: length``,
        #: as a real server does; off by default, so judges with a small ``max_tokens`` keep their whole answer
        self.enforce_max_tokens = enforce_max_tokens
        #: send ``usage`` (token counts) with every completion; False: omit it, as some servers do
        self.usage = usage
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._script: collections.deque[Fault | None] = collections.deque()
        self._api_keys: set[str] = set()
        self._stopping = threading.Event()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` (only once started)."""
        if self._httpd is None:
            raise RuntimeError("FakeOpenAIServer is not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def start(self) -> FakeOpenAIServer:
        """Bind a free port and serve from a daemon thread; returns ``self``."""
        self._stopping.clear()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner, self._httpd.open_sockets = self, set()
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-openai-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving at once: hung or delayed handlers are woken and drop their connections (no join)."""
        if self._httpd is None:
            return
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for sock in list(self._httpd.open_sockets):  # wake handler threads waiting on idle connections
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, *faults: Fault | None) -> None:
        """Queue per-request faults: the next requests get these in order (None = answer normally)."""
        with self._lock:
            self._script.extend(faults)

    def answered(self) -> int:
        """How many requests got a 200 completion (what a client paid for; a ``hang`` that outlives the client's
        timeout and is then answered counts too, as a real API would bill it; one cut short by ``stop()`` not)."""
        with self._lock:
            return sum(1 for r in self.requests if r.completed)

    def seen_api_keys(self) -> set[str]:
        """The bearer tokens received in ``Authorization`` headers."""
        with self._lock:
            return set(self._api_keys)

    # -- request handling (runs in handler threads) --------------------------------------------------------

    def _handle(self, h: _Handler, method: str) -> None:
        path = h.path.split("?", 1)[0].rstrip("/")
        raw = h.rfile.read(int(h.headers.get("content-length") or 0))
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in h.headers.items()}
        record = RecordedRequest(path=path, body=body if isinstance(body, dict) else {}, headers=headers, raw=raw)
        auth = headers.get("authorization", "")
        with self._lock:
            self.requests.append(record)
            if auth.lower().startswith("bearer "):
                self._api_keys.add(auth[7:].strip())
        if method == "GET" and path == "/v1/models":
            model = {"id": f"{self.model_prefix}fake-model", "object": "model", "created": 0, "owned_by": "fake"}
            return self._send(h, record, 200, {"object": "list", "data": [model]})
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return self._send(h, record, 404, _error(f"Unknown path {method} {path}", "invalid_request_error"))
        if not isinstance(body, dict):
            return self._send(h, record, 400, _error("Request body is not a JSON object", "invalid_request_error"))
        if self._stopping.wait(self.latency_s):
            return self._drop(h, record)
        with self._lock:
            scripted = self._script.popleft() if self._script else None
        answer = scripted or self.responder(body)
        if isinstance(answer, Fault):
            answer = self._fault(h, record, answer, scripted is not None, body)
            if answer is None:
                return
        record.completed = True
        self._send(h, record, 200, self._completion(path, body, answer))

    def _fault(self, h: _Handler, record: RecordedRequest, fault: Fault, scripted: bool, body: dict) -> str | None:
        """Act out ``fault``; returns the text to answer with when the fault still ends in a completion."""
        if fault.kind in ("429", "500", "503"):
            kind = {"429": "rate_limit_exceeded", "500": "server_error", "503": "service_unavailable"}[fault.kind]
            extra = {} if fault.retry_after is None else {"Retry-After": f"{fault.retry_after:g}"}
            self._send(h, record, int(fault.kind), _error(f"Fake {fault.kind}", kind, kind), extra)
        elif fault.kind == "echo_key":
            token = record.headers.get("authorization", "")[7:].strip()
            shown = " ".join(echo_forms(token)[form] for form in fault.echo.split("+"))
            self._send(h, record, fault.status, _error(f"Internal error while checking key {shown}", "server_error",
                                                        "invalid_api_key" if fault.status == 401 else None))
        elif fault.kind == "trickle":
            text = self._normal_answer(body, scripted)
            record.completed = True
            self._trickle(h, record, json.dumps(self._completion(record.path, body, text)).encode(), fault.seconds)
        elif fault.kind in ("no_choices", "null_content"):
            record.completed = True
            payload = self._completion(record.path, body, self._normal_answer(body, scripted))
            if fault.kind == "no_choices":
                payload["choices"] = []
            else:
                for choice in payload["choices"]:
                    choice["finish_reason"] = "length"
                    if "message" in choice:
                        choice["message"]["content"] = None
                    else:
                        choice["text"] = None
            self._send(h, record, 200, payload)
        elif fault.kind == "garbage":
            self._send(h, record, 200, None, raw=b'{"id": "chatcmpl-garbage", "choices": [{"mess')
        elif fault.kind == "wrong_count":
            answer = fault.text if fault.text is not None else self._normal_answer(body, scripted)
            lines = answer.rstrip("\n").splitlines()
            return "\n".join(lines[:-1]) if len(lines) > 1 else f"{answer}\nPair 2: 1"
        elif fault.kind == "close" or self._stopping.wait(fault.seconds):  # or a hang cut short by stop()
            self._drop(h, record)
        else:  # hang over: answer (the responder's own text if the hang was scripted, else the default's)
            return self._normal_answer(body, scripted)
        return None

    def _normal_answer(self, body: dict, scripted: bool) -> str:
        """What a faulted request would have been answered: the responder's text for a scripted fault (the
        responder did not choose it), else the default responder's."""
        answer = self.responder(body) if scripted else prefer_first_responder(body)
        return answer if isinstance(answer, str) else prefer_first_responder(body)

    def _completion(self, path: str, body: dict, text: str) -> dict:
        prompt_text = (" ".join(_content_text(m.get("content")) for m in body.get("messages", []))
                       if "messages" in body else request_text(body))
        n = int(body.get("n") or 1)
        chat = path.endswith("chat/completions")
        finish = "stop"
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if self.enforce_max_tokens and limit is not None and len(_split_tokens(text)) > int(limit):
            text, finish = "".join(_split_tokens(text)[:int(limit)]), "length"
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
                if body.get("logprobs"):
                    choice["logprobs"] = _chat_logprobs(text, int(body.get("top_logprobs") or 0))
            else:
                choice["text"] = text
                if body.get("logprobs") is not None:
                    choice["logprobs"] = _completion_logprobs(text, int(body["logprobs"]))
            choices.append(choice)
        usage = {"prompt_tokens": _tokens(prompt_text), "completion_tokens": _tokens(text) * n}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        payload = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                   "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                   "model": f"{self.model_prefix}{body.get('model', 'fake-model')}", "choices": choices}
        if self.usage:
            payload["usage"] = usage
        return payload

    def _trickle(self, h: _Handler, record: RecordedRequest, data: bytes, seconds: float) -> None:
        """Send a 200 with ``data`` spread evenly over ``seconds`` (headers at once, then the body in pieces)."""
        record.status = 200
        pieces = max(1, min(len(data), int(seconds * 10)))
        size = -(-len(data) // pieces)
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.flush()
            for start in range(0, len(data), size):
                if self._stopping.wait(seconds / pieces):
                    return self._drop(h, record)
                h.wfile.write(data[start:start + size])
                h.wfile.flush()
        except OSError:  # the client gave up (its deadline) before the end
            h.close_connection = True

    def _send(self, h: _Handler, record: RecordedRequest, status: int, payload: dict | None,
              headers: dict[str, str] | None = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        record.status = status
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                h.send_header(key, value)
            h.end_headers()
            h.wfile.write(data)
            h.wfile.flush()
        except OSError:  # the client gave up (timeout) before the answer
            h.close_connection = True

    def _drop(self, h: _Handler, record: RecordedRequest) -> None:
        record.status = 0
        h.close_connection = True
        with contextlib.suppress(OSError):
            h.connection.shutdown(socket.SHUT_RDWR)


def _error(message: str, type_: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": None}}
