"""The labelling page's web application (Starlette, served by uvicorn): the page, its two assets and a JSON API.

Routes: ``GET /`` (the page), ``GET /static/label.js`` and ``/static/label.css`` (a fixed table: no request path
ever reaches the file system), ``GET /api/next?labeller=NAME`` (the pair to label now, sides already arranged,
system names never sent) and ``POST /api/label`` (one label; JSON ``{labeller, pair_id, ticket, choice, reason}``).

Safety: the answers are put on the page with ``textContent`` by label.js, and a Content-Security-Policy allows
scripts from this server's own file only, so text that looks like HTML stays text. Requests with a Host header
other than the served address are refused (DNS rebinding), and a POST must be ``application/json`` (a page on
another site cannot send that without a CORS preflight, which this server never grants). With a token, the page
and every API call need it (``?token=`` on the page; label.js sends it as ``X-Label-Token``). Every refused request
gets a 4xx with ``{"error": "..."}`` and changes nothing.
"""

from __future__ import annotations

import hmac
import json
import re
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from alpacafarm_validation.label_store import CHOICES, LabelRejected, LabelStore

PAGE_DIR = Path(__file__).parent / "label_page"
ASSETS = {"label.js": "text/javascript; charset=utf-8", "label.css": "text/css; charset=utf-8"}
MAX_BODY = 16_384
MAX_REASON = 2_000
#: A labeller's name: letters, digits, spaces and . _ @ - (it is stored and shown, never used as a path).
NAME = re.compile(r"^[\w .@-]{1,40}$")
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


def _labeller(value: Any) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value.strip()):
        raise LabelRejected(400, "labeller must be a name of 1-40 letters, digits, spaces or . _ @ -")
    return value.strip()


def make_app(store: LabelStore, token: str | None = None, hosts: list[str] | None = None) -> Starlette:
    """The application over ``store``; ``token``: required on the page and the API when set; ``hosts``: the Host
    header values accepted (default: the loopback names)."""

    def authorised(supplied: str | None) -> bool:
        return token is None or (supplied is not None and hmac.compare_digest(supplied.encode(), token.encode()))

    async def page(request: Request) -> Response:
        if not authorised(request.query_params.get("token")):
            return Response("this labelling page needs its access token: open the link the server printed\n",
                            status_code=401, media_type="text/plain", headers=SECURITY_HEADERS)
        html = (PAGE_DIR / "index.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:  # a fixed table: '..', encoded slashes and other files are all just unknown
            return _error(404, "not found")
        return Response((PAGE_DIR / name).read_bytes(), media_type=ASSETS[name], headers=SECURITY_HEADERS)

    async def next_pair(request: Request) -> Response:
        if not authorised(request.headers.get("x-label-token")):
            return _error(401, "missing or wrong access token")
        try:
            labeller = _labeller(request.query_params.get("labeller"))
        except LabelRejected as exc:
            return _error(exc.status, str(exc))
        return JSONResponse(await run_in_threadpool(store.next_pair, labeller), headers=SECURITY_HEADERS)

    async def label(request: Request) -> Response:
        if not authorised(request.headers.get("x-label-token")):
            return _error(401, "missing or wrong access token")
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return _error(415, "send the label as application/json")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return _error(413, f"body larger than {MAX_BODY} bytes")
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, f"body larger than {MAX_BODY} bytes")
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return _error(400, "body is not JSON")
        try:
            labeller, pair_id, ticket, choice, reason = _label_fields(data)
            progress = await run_in_threadpool(store.record, labeller, pair_id, ticket, choice, reason)
        except LabelRejected as exc:
            return _error(exc.status, str(exc))
        return JSONResponse({"stored": True, "progress": progress}, headers=SECURITY_HEADERS)

    routes = [Route("/", page), Route("/static/{name}", asset), Route("/api/next", next_pair),
              Route("/api/label", label, methods=["POST"])]
    allowed = hosts or ["127.0.0.1", "localhost", "[::1]"]
    return Starlette(routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed)])


def _label_fields(data: Any) -> tuple[str, str, str, str, str]:
    """The five fields of a label request, checked; anything else is a 400 naming the field."""
    if not isinstance(data, dict):
        raise LabelRejected(400, "body must be a JSON object")
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
    return _labeller(data.get("labeller")), data["pair_id"], data["ticket"], data["choice"], reason.strip()
