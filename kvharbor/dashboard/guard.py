"""Who may ask the dashboard anything: the Host check and the token, as ASGI middleware.

Order of the checks, and why:

0. Request line and headers over ``dashboard.request_header_bytes_max``: 431. uvicorn's
   h11 bounds what it buffers of headers that arrive slowly with the same setting, but
   takes whole a header block that arrived at once; this bounds that too.
1. ``/healthz`` and ``/readyz`` are open: probes (systemd, a Kubernetes kubelet) reach
   the pod by its address and send no token; they learn only "alive" and "ready, or
   why not".
2. The Host header must name one of ``dashboard.allowed_hosts`` (``*``: any), else
   403 ``{"error": "bad Host header"}``: a page of another site that has its name
   resolve to 127.0.0.1 (DNS rebinding) reaches the dashboard under its own name.
3. With ``dashboard.auth_token`` set, ``Authorization: Bearer <token>`` or
   ``?token=<token>``, else 401 ``{"error": "unauthorized"}``; compared in constant
   time. ``/metrics`` too: Prometheus sends it as ``authorization: credentials``.

The settings are read on every request (`Guard` is given a function, not a copy), so a
token or host list changed through ``POST /api/config`` applies to the next request.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from kvharbor.config import DashboardSection

if TYPE_CHECKING:  # Types only: the gateway imports this module without the web stack.
    from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Answered without the Host check and the token: probes."""
ANY_HOST = "*"


def host_name(header: str) -> str:
    """The name in a Host header, without its port: ``[::1]:9400`` -> ``::1``, ``a:80`` -> ``a``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, _ = header.partition(":")
    return name


def addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[str, int]]]:
    """What ``host`` (an address or a name) resolves to, as (family, (address, port)); raises OSError.
    An address is taken as written, with no resolver call."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        # Bytes: a str name would be IDNA-encoded, through a codec a process that cannot
        # import it (a restricted user's interpreter) fails on with LookupError, not OSError.
        infos = socket.getaddrinfo(host.encode(), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        return [(info[0], (str(info[4][0]), port)) for info in infos]
    family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
    return [(family, (host, port))]


def is_loopback(host: str) -> bool:
    """True if every address ``host`` resolves to is a loopback address (``localhost``,
    127.0.0.0/8, ::1); a name that does not resolve is not."""
    try:
        found = addresses(host, 0)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(address).is_loopback for _, (address, _) in found)


def exposure_problem(section: DashboardSection) -> str | None:
    """Why ``section`` must not be served, or None: a bind other than loopback without a
    token would hand the cache's figures and the config to anyone on the network."""
    if section.auth_token is None and not is_loopback(section.host):
        return (
            f"dashboard.host {section.host} is not a loopback address and dashboard.auth_token is not set; "
            "set a token, or keep 127.0.0.1 and reach it through ssh -L"
        )
    return None


def _token_of(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return credentials.strip()
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0] if values else None


def token_matches(given: str | None, token: str) -> bool:
    # compare_digest: the time taken says nothing about how much of a guess was right.
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def _host_of(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            return host_name(value.decode("latin-1"))
    return ""


def _head_bytes(scope: Scope) -> int:
    """The size of the request line and headers, as sent (give or take separators)."""
    line = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b""))
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))


async def _refuse(send: Send, status: int, error: str, extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware in front of the whole app; ``settings`` gives the dashboard section in force."""

    def __init__(self, app: ASGIApp, settings: Callable[[], DashboardSection]) -> None:
        self._app = app
        self._settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        settings = self._settings()
        if _head_bytes(scope) > settings.request_header_bytes_max:
            limit = settings.request_header_bytes_max
            await _refuse(
                send, 431, f"request headers larger than dashboard.request_header_bytes_max ({limit} bytes)", []
            )
            return
        if scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        allowed = {name.lower() for name in settings.allowed_hosts}
        if ANY_HOST not in allowed and _host_of(scope) not in allowed:
            await _refuse(send, 403, "bad Host header", [])
            return
        if settings.auth_token is not None and not token_matches(_token_of(scope), settings.auth_token):
            await _refuse(send, 401, "unauthorized", [(b"www-authenticate", b"Bearer")])
            return
        await self._app(scope, receive, send)
