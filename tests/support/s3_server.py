"""A real S3 server for the tests: moto in server mode, as a subprocess, and a real HTTP
proxy in front of it that can be switched to answer 500s or to hang.

Nothing here patches boto3: the tier talks HTTP to a server on a socket. The server
can run inside a network namespace (``prefix``: ``["ip", "netns", "exec", NAME]``)
and with moto's IAM checks on (``authenticated``), where only the access key the
fixture made is accepted.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import http.client
import http.server
import json
import os
import re
import select
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from kvharbor.config import S3TierSection
from kvharbor.hal.s3 import S3Device

MOTO_SERVER = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "moto_server"
START_TIMEOUT_S = 60.0
"""Bound on moto's start (an import of boto and werkzeug on a loaded 2-core machine)."""
REGION = "us-east-1"
_RUNNING = re.compile(rb"Running on http://([0-9.]+):([0-9]+)")
TEST_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
"""moto without IAM checks takes any key; the AWS chain still needs one to sign."""


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}


class MotoServer:
    """``moto_server`` on ``host``, a port of the system's choice, as a child process."""

    def __init__(self, host: str = "127.0.0.1", prefix: list[str] | None = None, authenticated: bool = False) -> None:
        env = {**os.environ, **TEST_KEYS}
        if authenticated:
            # moto checks IAM after this many requests: the fixture's own three set up the user.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self.process = subprocess.Popen(
            [*(prefix or []), str(MOTO_SERVER), "-H", host, "-p", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()
        self.host, self.port = self._wait_running()
        self.url = f"http://{self.host}:{self.port}"
        self.credentials = Credentials(TEST_KEYS["AWS_ACCESS_KEY_ID"], TEST_KEYS["AWS_SECRET_ACCESS_KEY"])
        if authenticated:
            self.credentials = self._make_user()
        # Drain its log so that a chatty server never blocks on a full pipe.
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()

    def _wait_running(self) -> tuple[str, int]:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        seen = b""
        deadline = time.monotonic() + START_TIMEOUT_S
        while (match := _RUNNING.search(seen)) is None:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                self.stop()
                raise RuntimeError(f"moto_server did not start: {seen.decode(errors='replace')}")
            seen += chunk
        return match.group(1).decode(), int(match.group(2))

    def _read_log(self) -> None:
        assert self.process.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            while self.process.stdout.read(65536):
                pass

    def _make_user(self) -> Credentials:
        iam = boto3.client("iam", endpoint_url=self.url, region_name=REGION, **_keys(TEST_KEYS))
        iam.create_user(UserName="kvharbor")
        key = iam.create_access_key(UserName="kvharbor")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="kvharbor", PolicyName="s3", PolicyDocument=json.dumps(policy))
        return Credentials(key["AccessKeyId"], key["SecretAccessKey"])

    def client(self, url: str | None = None) -> Any:
        """A plain boto3 client of the server, with the fixture's credentials (one per
        address, kept: making a client costs ~0.5 s here)."""
        url = url or self.url
        with self._clients_lock:
            if url not in self._clients:
                self._clients[url] = self._new_client(url)
            return self._clients[url]

    def _new_client(self, url: str) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=url,
            region_name=REGION,
            aws_access_key_id=self.credentials.access_key_id,
            aws_secret_access_key=self.credentials.secret_access_key,
        )

    def bucket(self) -> str:
        """A new, empty bucket of its own for one test."""
        name = f"kvh-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _keys(env: dict[str, str]) -> dict[str, str]:
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}


class Mode(enum.Enum):
    PASS = "pass"
    """Forward every request to the server."""
    ERROR = "error"
    """Answer every request 500 InternalError."""
    HANG = "hang"
    """Read every request and answer nothing until the mode changes (a timeout for the client)."""


Matcher = Callable[[str, str], bool]
"""Takes a request's method and path with query; True: the mode applies to it."""


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up mid-answer is what the faults are for.
        return None


class FaultProxy:
    """A real HTTP proxy on loopback in front of an S3 server; `mode` switches what it does
    with requests (those ``applies`` to, all by default), counting them in ``requests``."""

    def __init__(self, upstream: str) -> None:
        match = re.fullmatch(r"http://([^:/]+):([0-9]+)", upstream)
        assert match is not None, upstream
        self._upstream = (match.group(1), int(match.group(2)))
        self._mode = Mode.PASS
        self._applies: Matcher = lambda _method, _path: True
        self._changed = threading.Condition()
        self.requests = 0
        self.faulted = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                mode = proxy._enter(self.command, self.path)
                if mode is Mode.HANG:
                    proxy._hang_until_changed()
                    self.close_connection = True
                    return
                if mode is Mode.ERROR:
                    payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                proxy._forward(self, body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_one

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="s3-fault-proxy")
        self._thread.start()

    def mode(self, mode: Mode, applies: Matcher | None = None) -> None:
        with self._changed:
            self._mode = mode
            self._applies = applies or (lambda _method, _path: True)
            self._changed.notify_all()

    def _enter(self, method: str, path: str) -> Mode:
        with self._changed:
            self.requests += 1
            mode = self._mode if self._applies(method, path) else Mode.PASS
            if mode is not Mode.PASS:
                self.faulted += 1
            return mode

    def _hang_until_changed(self) -> None:
        with self._changed:
            mode = self._mode
            # A wait on the switch itself: the fault lasts until the test ends it.
            self._changed.wait_for(lambda: self._mode is not mode)

    def _forward(self, handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        connection = http.client.HTTPConnection(*self._upstream, timeout=60)
        try:
            headers = {name: value for name, value in handler.headers.items() if name.lower() != "connection"}
            connection.request(handler.command, handler.path, body=body, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
        finally:
            connection.close()
        handler.send_response_only(answer.status, answer.reason)
        for name, value in answer.getheaders():
            if name.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                handler.send_header(name, value)
        handler.send_header("Date", answer.getheader("Date") or handler.date_time_string())
        handler.send_header("Content-Length", answer.getheader("Content-Length") or str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def close(self) -> None:
        self.mode(Mode.PASS)  # Releases hanging requests.
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def moto_server(**kw: Any) -> Iterator[MotoServer]:
    server = MotoServer(**kw)
    try:
        yield server
    finally:
        server.stop()


def s3_tier(server_url: str, bucket: str, name: str = "s3", **settings: Any) -> dict[str, Any]:
    """A tier section for ``bucket`` at ``server_url``, tuned for tests: no retries and short
    timeouts, so that a fault is judged in a request, not after botocore's backoff."""
    tier: dict[str, Any] = {
        "name": name,
        "type": "s3",
        "bucket": bucket,
        "endpoint_url": server_url,
        "region": REGION,
        "capacity_gb": 1,
        "retries_max": 0,
        "connect_timeout_ms": 1000,
        "read_timeout_ms": 2000,
    }
    tier.update(settings)
    return tier


_SHARED: MotoServer | None = None
_SHARED_LOCK = threading.Lock()


def shared_server() -> MotoServer:
    """One server for the whole test process, started on first use and stopped at exit:
    tests that need only a working server share it (each in a bucket of its own)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MotoServer()
            atexit.register(_SHARED.stop)
        return _SHARED


def s3_device_on(
    server: MotoServer, max_value_bytes: int, url: str | None = None, bucket: str | None = None, **settings: Any
) -> S3Device:
    """An `S3Device` on ``bucket`` (by default a new one) of ``server``, reached at ``url``
    (a proxy in front of it) or directly."""
    section = S3TierSection.model_validate(s3_tier(url or server.url, bucket or server.bucket(), **settings))
    with credentials_in_env(server.credentials):
        return S3Device(section, max_value_bytes)


@contextlib.contextmanager
def credentials_in_env(credentials: Credentials) -> Iterator[None]:
    """The AWS chain of this process finds ``credentials`` (the environment comes first in it)."""
    saved = {name: os.environ.get(name) for name in credentials.env()}
    os.environ.update(credentials.env())
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
