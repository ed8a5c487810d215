"""The labelling page's web application (Starlette, served by uvicorn): the page, the team page, two assets and a
JSON API.

Routes: ``GET /`` (the page), ``GET /team`` (who labelled how many, overlap done, agreement so far; refreshes
itself), ``GET /static/label.js`` and ``/static/label.css`` (a fixed table: no request path ever reaches the file
system), ``GET /api/session`` (how people sign in, the guidelines), ``GET /api/team`` (the team page's numbers).
Everything that changes state is a POST with a JSON body: ``/api/me`` (who am I), ``/api/next`` (the pair to
label now, leased to me), ``/api/label`` (one label: ``{pair_id, ticket, choice, reason}``), ``/api/undo`` (take
back my last label and show that pair again), ``/api/lease`` (``{ticket, action: renew|release}``).

Who is labelling comes from the invite token the page sends as ``X-Label-Token`` when the session has invites
(:mod:`alpacafarm_validation.label_identity`); otherwise from a typed name (behind the shared ``--random-token``
beyond loopback). Safety: label.js builds the page from text nodes only, and a Content-Security-Policy allows
scripts from this server's own file only. Requests with a Host header other than the served address are refused
(DNS rebinding); a POST must be ``application/json`` (a page on another site cannot send that without a CORS
preflight, which this server never grants). Every refused or failed request gets ``{"error": "..."}`` with a 4xx
or 5xx, never a plain-text page or a traceback; a store that cannot be written (disk full, read-only) is a 503
and one line in the log, once, naming the store.
"""

from __future__ import annotations

import hmac
import html
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from alpacafarm_validation import label_identity
from alpacafarm_validation.label_store import CHOICES, LabelRejected, LabelStore, StoreUnavailable

PAGE_DIR = Path(__file__).parent / "label_page"
ASSETS = {"label.js": "text/javascript; charset=utf-8", "label.css": "text/css; charset=utf-8",
          "markdown.js": "text/javascript; charset=utf-8"}
MAX_BODY = 16_384
MAX_REASON = 2_000
FIELDS = {"labeller", "pair_id", "ticket", "choice", "reason"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'none'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token may be in the page's URL
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=SECURITY_HEADERS)


class StoreLog:
    """Says that the store cannot be used (disk full, read-only, ...) once, in one line naming the store: again
    only after :data:`REPEAT_S` seconds (with how many requests failed meanwhile); other unexpected errors get one
    line each (the first with its traceback)."""

    REPEAT_S = 600.0

    def __init__(self) -> None:
        self._said: dict[str, float] = {}
        self._since: dict[str, int] = {}
        self._lock = threading.Lock()
        self._traced = False

    def failed(self, exc: StoreUnavailable) -> None:
        now = time.monotonic()
        with self._lock:
            kind = "storage" if exc.condition != "busy" else "busy"
            if kind in self._said and now - self._said[kind] < self.REPEAT_S:
                self._since[kind] = self._since.get(kind, 0) + 1
                return
            self._said[kind], more = now, self._since.pop(kind, 0)
        again = f"; {more} more requests failed so since the last such line" if more else ""
        print(f"label server: {exc} (said once; the page gets 503 until it is fixed{again})", file=sys.stderr,
              flush=True)

    def bug(self, exc: BaseException) -> None:
        import traceback

        with self._lock:
            first, self._traced = not self._traced, True
        text = "".join(traceback.format_exception(exc)) if first else ""
        print(f"label server: internal error {type(exc).__name__}: {exc}\n{text}".rstrip(), file=sys.stderr,
              flush=True)


class HostCheck:
    """Refuses, with the JSON error, a request whose Host header is not one of ``hosts`` ("*": any)."""

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.hosts:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.hosts:
                await _error(400, "unknown host name for this server (DNS rebinding?)")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_app(store: LabelStore, token: str | None = None, hosts: list[str] | None = None,
             guidelines: str | None = None) -> Starlette:
    """The application over ``store``; ``token``: the shared access token required on the page and the API when
    set (invite links work in its place); ``hosts``: the Host header values accepted (default: the loopback
    names); ``guidelines``: text (markdown) shown to every labeller."""
    log = StoreLog()

    def shared_ok(supplied: str | None) -> bool:
        return token is None or (supplied is not None and hmac.compare_digest(supplied.encode(), token.encode()))

    def page_allowed(supplied: str | None) -> bool:
        def check(db: Any) -> bool:
            if label_identity.invite_mode(db):
                return bool(supplied) and (label_identity.valid_page_token(db, supplied)  # type: ignore[arg-type]
                                           or (token is not None and shared_ok(supplied)))
            return shared_ok(supplied)
        return store.run("check the access token", check, write=False)

    def labeller_of(request: Request, typed: object) -> str:
        supplied = request.headers.get("x-label-token")

        def resolve(db: Any) -> str:
            if not label_identity.invite_mode(db) and not shared_ok(supplied):
                raise LabelRejected(401, "missing or wrong access token")
            return label_identity.identify(db, supplied, typed)
        return store.run("identify the labeller", resolve)

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                response = await handler(request)
            except LabelRejected as exc:
                return _error(exc.status, str(exc))
            except StoreUnavailable as exc:
                log.failed(exc)
                return _error(503, str(exc))
            except Exception as exc:  # a bug: the JSON error, one line in the log (not a traceback a request)
                log.bug(exc)
                return _error(500, f"internal error ({type(exc).__name__}); the server's log has the details")
            return response
        return run

    async def body_of(request: Request) -> dict[str, Any]:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise LabelRejected(415, "body must be application/json")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            raise LabelRejected(413, f"body larger than {MAX_BODY} bytes")
        body = await request.body()
        if len(body) > MAX_BODY:
            raise LabelRejected(413, f"body larger than {MAX_BODY} bytes")
        try:
            data = json.loads(body.decode("utf-8")) if body.strip() else {}
        except (UnicodeDecodeError, ValueError):
            raise LabelRejected(400, "body is not JSON") from None
        if not isinstance(data, dict):
            raise LabelRejected(400, "body must be a JSON object")
        return data

    def ok(data: dict[str, Any]) -> JSONResponse:
        return JSONResponse(data, headers=SECURITY_HEADERS)

    async def page(request: Request) -> Response:
        if not await run_in_threadpool(page_allowed, request.query_params.get("token")):
            raise LabelRejected(401, "this labelling page needs its access token: open the link you were sent")
        text = (PAGE_DIR / "index.html").read_text(encoding="utf-8")
        return Response(text, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:  # a fixed table: '..', encoded slashes and other files are all just unknown
            raise LabelRejected(404, "not found")
        return Response((PAGE_DIR / name).read_bytes(), media_type=ASSETS[name], headers=SECURITY_HEADERS)

    async def session(request: Request) -> Response:
        if not await run_in_threadpool(page_allowed, request.headers.get("x-label-token")):
            raise LabelRejected(401, "missing or wrong access token")
        invites = await run_in_threadpool(store.run, "read it", label_identity.invite_mode, False)
        return ok({"mode": "invite" if invites else "name", "guidelines": guidelines or "",
                   "choices": list(CHOICES)})

    async def me(request: Request) -> Response:
        data = await body_of(request)
        return ok({"labeller": await run_in_threadpool(labeller_of, request, data.get("labeller"))})

    async def next_pair(request: Request) -> Response:
        data = await body_of(request)
        who = await run_in_threadpool(labeller_of, request, data.get("labeller"))
        return ok(await run_in_threadpool(store.next_pair, who) | {"labeller": who})

    async def label(request: Request) -> Response:
        data = await body_of(request)
        pair_id, ticket, choice, reason = _label_fields(data)
        who = await run_in_threadpool(labeller_of, request, data.get("labeller"))
        progress = await run_in_threadpool(store.record, who, pair_id, ticket, choice, reason)
        return ok({"stored": True, "progress": progress})

    async def undo(request: Request) -> Response:
        data = await body_of(request)
        who = await run_in_threadpool(labeller_of, request, data.get("labeller"))
        return ok(await run_in_threadpool(store.undo, who) | {"labeller": who})

    async def lease(request: Request) -> Response:
        data = await body_of(request)
        ticket, action = data.get("ticket"), data.get("action")
        if not isinstance(ticket, str) or not ticket or len(ticket) > 100 or action not in ("renew", "release"):
            raise LabelRejected(400, "a lease request is {ticket, action: renew or release}")
        who = await run_in_threadpool(labeller_of, request, data.get("labeller"))
        changed = await run_in_threadpool(store.lease, who, ticket, action == "renew")
        return ok({"renewed" if action == "renew" else "released": changed})

    async def team_data(request: Request) -> Response:
        from alpacafarm_validation.label_team import team_summary

        if not await run_in_threadpool(page_allowed, request.headers.get("x-label-token")):
            raise LabelRejected(401, "missing or wrong access token")
        return ok(await run_in_threadpool(team_summary, store))

    async def team_page(request: Request) -> Response:
        from alpacafarm_validation.label_team import team_html, team_summary

        supplied = request.query_params.get("token")
        if not await run_in_threadpool(page_allowed, supplied):
            raise LabelRejected(401, "the team page needs an access token: open it from your link, /team?token=...")
        summary = await run_in_threadpool(team_summary, store)
        refresh = "/team" + (f"?token={html.escape(supplied)}" if supplied else "")
        return Response(team_html(summary, refresh), media_type="text/html; charset=utf-8",
                        headers=SECURITY_HEADERS)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return _error(status, str(detail))

    routes = [Route("/", guarded(page)), Route("/team", guarded(team_page)),
              Route("/static/{name}", guarded(asset)), Route("/api/session", guarded(session)),
              Route("/api/team", guarded(team_data))]
    routes += [Route(f"/api/{name}", guarded(handler), methods=["POST"])
               for name, handler in (("me", me), ("next", next_pair), ("label", label), ("undo", undo),
                                     ("lease", lease))]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.add_middleware(HostCheck, hosts=hosts or ["127.0.0.1", "localhost", "[::1]"])
    return app


def _label_fields(data: dict[str, Any]) -> tuple[str, str, str, str]:
    """The fields of a label request, checked; anything else is a 400 naming the field."""
    unknown = set(data) - FIELDS
    if unknown:
        raise LabelRejected(400, f"unknown field {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(FIELDS))})")
    for key in ("pair_id", "ticket", "choice"):
        if not isinstance(data.get(key), str) or not data[key] or len(data[key]) > 100:
            raise LabelRejected(400, f"field {key!r} must be a non-empty string")
    reason = data.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise LabelRejected(400, f"field 'reason' must be a string of at most {MAX_REASON} characters")
    if data["choice"] not in CHOICES:
        raise LabelRejected(400, f"field 'choice' must be one of {', '.join(CHOICES)}")
    return data["pair_id"], data["ticket"], data["choice"], reason.strip()
