"""The dashboard's Starlette app: the page, its JSON API, ``/metrics`` and the probes.

Endpoints (all answer JSON, errors as ``{"error": "..."}``, never a traceback):

- ``GET /``: the page (``static/index.html``); ``/static/...`` its code and the vendored uPlot;
- ``GET /api/status``: the gateway's status; ``GET /api/history``: the charts' samples
  (`history.History`); ``GET /api/log``: recent kvharbor log lines (`logbuffer.RecentLog`);
- ``GET /metrics``: the gateway's Prometheus registry, in the text exposition format;
- ``GET /healthz``: the process answers; ``GET /readyz``: the gateway accepts clients
  with its store open, else 503 with the reason;
- ``GET /api/config``: the config in force and its file; ``POST /api/config``: an edit
  (`config_edit.ConfigEditor`), its body at most ``dashboard.request_body_bytes_max``.

Handlers are plain functions: Starlette runs them on its worker threads, so reading the
gateway's state (which takes its locks) never blocks the event loop.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path
from urllib.parse import quote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from kvharbor.dashboard.config_edit import LIVE_KEYS, ConfigEditor, ConfigEditRefused, dump
from kvharbor.dashboard.guard import Guard
from kvharbor.dashboard.history import History
from kvharbor.dashboard.hooks import GatewayHooks
from kvharbor.dashboard.logbuffer import RecentLog
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.dashboard")

STATIC_DIR = Path(__file__).with_name("static")
PAGE_QUERY = "{{query}}"
"""Where the page's links take the request's ``?token=``: a script or stylesheet the
browser loads by itself cannot send a header, and every request but the probes needs it."""
PAGE_REFRESH = "{{refresh_interval_ms}}"


class BodyTooLarge(Exception):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    """The body, refused past ``limit_bytes`` whatever Content-Length claims (it may lie or be absent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise BodyTooLarge
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise BodyTooLarge
    return bytes(body)


def build_app(hooks: GatewayHooks, history: History, recent: RecentLog, editor: ConfigEditor) -> ASGIApp:
    page = (STATIC_DIR / "index.html").read_text()

    def index(request: Request) -> HTMLResponse:
        token = request.query_params.get("token")
        query = html.escape(f"?token={quote(token, safe='')}") if token is not None else ""
        refresh = str(hooks.config().dashboard.refresh_interval_ms)
        return HTMLResponse(page.replace(PAGE_QUERY, query).replace(PAGE_REFRESH, refresh))

    def status(_: Request) -> JSONResponse:
        return JSONResponse(hooks.status())

    def history_(_: Request) -> JSONResponse:
        return JSONResponse(history.document())

    def log(_: Request) -> JSONResponse:
        return JSONResponse({"lines": recent.document()})

    def metrics(_: Request) -> Response:
        return Response(generate_latest(hooks.registry()), media_type=CONTENT_TYPE_LATEST)

    def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    def readyz(_: Request) -> JSONResponse:
        reason = hooks.readiness()
        if reason is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    def config_get(_: Request) -> JSONResponse:
        config = hooks.config()
        return JSONResponse({
            "path": None if editor.path is None else str(editor.path),
            "allow_config_edit": config.dashboard.allow_config_edit,
            "live_keys": sorted(LIVE_KEYS),
            "config": dump(config),
        })  # fmt: skip

    async def config_post(request: Request) -> JSONResponse:
        limit = hooks.config().dashboard.request_body_bytes_max
        try:
            editor.ensure_allowed()
        except ConfigEditRefused as refused:
            return _error(refused.status, refused.message)
        try:
            body = await _read_body(request, limit)
        except BodyTooLarge:
            return _error(413, f"the body is larger than dashboard.request_body_bytes_max ({limit} bytes)")
        try:
            patch = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"the body is not JSON: {err}")
        try:
            # The editor reads and writes a file and takes a lock: off the event loop.
            outcome = await run_in_threadpool(editor.edit, patch)
        except ConfigEditRefused as refused:
            return _error(refused.status, refused.message)
        _log.info(
            "kvharbor: config edited from the dashboard (%s): applied at once: %s; at the next start: %s",
            outcome.written, ", ".join(outcome.applied_now) or "nothing", ", ".join(outcome.at_next_start) or "nothing",
        )  # fmt: skip
        return JSONResponse(asdict(outcome))

    routes: list[BaseRoute] = [
        Route("/", index),
        Route("/api/status", status),
        Route("/api/history", history_),
        Route("/api/log", log),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/api/config", config_get, methods=["GET"]),
        Route("/api/config", config_post, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR)),
    ]
    return _assemble(routes, hooks)


def build_metrics_app(hooks: GatewayHooks) -> ASGIApp:
    """The ``telemetry.prometheus.port`` listener's app: ``/metrics`` alone, behind the same guard."""

    def metrics(_: Request) -> Response:
        return Response(generate_latest(hooks.registry()), media_type=CONTENT_TYPE_LATEST)

    return _assemble([Route("/metrics", metrics)], hooks)


def _assemble(routes: list[BaseRoute], hooks: GatewayHooks) -> ASGIApp:
    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error serving {request.url.path}; the gateway's log says more")

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})
    return _Contained(Guard(app, lambda: hooks.config().dashboard))


class _Contained:
    """The outermost layer: a bug in a handler was answered 500 by Starlette, which then
    raises it again for the server to log; it is said here once per kind (with the
    ``kvharbor:`` prefix) instead, and the gateway serves on."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._once = OnceLog(_log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._app(scope, receive, send)
        except Exception as err:
            path = scope.get("path", "?")
            self._once.say(f"{path}:{type(err).__name__}", f"dashboard: internal error serving {path}: {err!r}")
