"""Reaching a real gateway's dashboard over real HTTP, for the dashboard tests."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from gateway_harness import WAIT_S, GatewayProcess, closing_client

TOKEN = "s3cret-token"


@dataclass(frozen=True)
class Ports:
    dashboard: int
    metrics: int | None


def ports_of(gateway: GatewayProcess) -> Ports | None:
    """The ports the gateway bound (it reports them in its status), None if it serves no dashboard."""
    with closing_client(gateway.client("ports")) as client:
        status = client.status()
    if status.dashboard_url is None:
        return None
    metrics = None if status.metrics_url is None else urlsplit(status.metrics_url).port
    dashboard = urlsplit(status.dashboard_url).port
    assert dashboard is not None, status.dashboard_url
    return Ports(dashboard, metrics)


def http(port: int, token: str | None = TOKEN) -> httpx.Client:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=WAIT_S)


def raw_request(port: int, request: bytes) -> bytes:
    """Send ``request`` as is and read the whole answer (the server closes, or the answer is
    complete). A server that answers and hangs up before it read all of a large request
    resets the connection: what came before the reset is returned."""
    answer = b""
    with (
        contextlib.suppress(ConnectionResetError, BrokenPipeError),
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock,
    ):
        sock.sendall(request)
        while chunk := sock.recv(65536):
            answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)  # fmt: skip
            if length is not None and len(body) >= length:
                break
    return answer
