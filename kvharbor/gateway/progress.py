"""PROGRESS frames: a client waiting on a long request learns that it is still being served.

A client gives up on a gateway silent for ``gateway.request_timeout_ms`` and turns its
cache off for good. A request can be long without being hung: a commit of many values
to a slow tier, or one write that waits for the host's writeback (a file tier's fsync
was seen taking 6 s beside another job's writes). So while a request is in service its
client hears from the gateway at least every ``gateway.progress_interval_ms``:

- the serving thread reports as the request's items complete (`RequestProgress.__call__`);
- the heartbeat thread reports for it while one item takes long (`Heartbeat`), up to
  ``gateway.request_max_ms`` after the request began: a request still in service then
  is taken for hung, and its client's silence limit runs out as it would have without
  the heartbeat.

A PROGRESS frame and the answer share the socket. `RequestProgress.serving` is the only
way to serve a request, and its end waits for a frame being sent; none is sent after it,
so the answer, sent after, is never interleaved with, nor followed by, a PROGRESS.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self

from kvharbor.gateway import protocol as p
from kvharbor.periodic import Periodic


class RequestProgress:
    """The progress of the request one connection is serving (one at a time)."""

    def __init__(self, sock: socket.socket, interval_s: float, max_s: float) -> None:
        if not 0 < interval_s < max_s:
            raise ValueError(f"need 0 < interval ({interval_s} s) < max ({max_s} s)")
        self._sock = sock
        self._interval_s = interval_s
        self._max_s = max_s
        self._lock = threading.Lock()
        """Held while a frame is sent, and to start or end a request."""
        self._request_id: int | None = None
        """The request in service; None between requests."""
        self._began = 0.0
        self._next = 0.0
        self._done = 0

    @contextmanager
    def serving(self, request_id: int) -> Iterator[Self]:
        """Serve ``request_id`` inside; PROGRESS frames for it are sent only inside."""
        with self._lock:
            assert self._request_id is None, "one request at a time per connection"
            self._request_id = request_id
            self._began = time.monotonic()
            self._next = self._began + self._interval_s
            self._done = 0
        try:
            yield self
        finally:
            with self._lock:  # Waits for a frame being sent: the answer goes after it.
                self._request_id = None

    def __call__(self, done: int) -> None:
        """The serving thread: ``done`` items of the request are complete."""
        with self._lock:
            self._done = done
            self._send_if_due(time.monotonic())

    def beat(self, now: float) -> None:
        """The heartbeat thread: report for a request in service, if one is due."""
        with self._lock:
            if self._request_id is not None and now - self._began < self._max_s:
                # Not blocking: one client that stopped reading must not silence the others.
                self._send_if_due(now, block=False)

    def _send_if_due(self, now: float, block: bool = True) -> None:
        if self._request_id is None or now < self._next:
            return
        frame = p.encode(p.Progress(self._done), self._request_id)
        if block:
            self._sock.sendall(frame)
        else:
            try:
                sent = self._sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return  # A client not reading its socket: it does not wait for us either.
            if sent < len(frame):
                self._sock.sendall(frame[sent:])  # Never half a frame.
        self._next = now + self._interval_s


class Heartbeat:
    """One thread that beats for every connection's request in service."""

    def __init__(self, interval_s: float) -> None:
        self._connections: set[RequestProgress] = set()
        self._lock = threading.Lock()
        # Twice per interval: a report falls due at most half an interval before it is sent.
        self._periodic = Periodic("kvharbor-heartbeat", interval_s / 2, self._beat)

    def start(self) -> Self:
        self._periodic.start()
        return self

    def stop(self) -> None:
        self._periodic.stop()

    def add(self, progress: RequestProgress) -> None:
        with self._lock:
            self._connections.add(progress)

    def remove(self, progress: RequestProgress) -> None:
        with self._lock:
            self._connections.discard(progress)

    def _beat(self) -> None:
        with self._lock:
            connections = list(self._connections)
        now = time.monotonic()
        for progress in connections:
            with contextlib.suppress(OSError):  # A client gone: its serving thread disconnects it.
                progress.beat(now)
