"""A request that outlasts half of ``gateway.request_timeout_ms``: said once, with every thread's stack.

A client gives up on a gateway silent for ``request_timeout_ms`` and turns its cache off
for good, and a hung request leaves nothing in the gateway's log to say where it hung.
The watchdog's thread looks at the requests in service every quarter of the threshold;
one past it is said once (a WARNING, the request's type and client), followed by the
stack of every thread of the gateway, so the next such fault names its cause.

The serving threads pay two dictionary writes per request (`begin`, `end`).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Self

from kvharbor.gateway import protocol as p
from kvharbor.periodic import Periodic
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")


class RequestWatchdog:
    def __init__(self, threshold_s: float) -> None:
        if threshold_s <= 0:
            raise ValueError(f"the watchdog's threshold must be > 0 s, got {threshold_s}")
        self.threshold_s = threshold_s
        self._serving: dict[int, tuple[float, int, str]] = {}
        """Serving thread's ident -> (when its request began, its message type, its client)."""
        self._said: set[tuple[int, float]] = set()
        self._periodic = Periodic("kvharbor-watchdog", threshold_s / 4, self._look)

    def start(self) -> Self:
        self._periodic.start()
        return self

    def stop(self) -> None:
        self._periodic.stop()

    def begin(self, kind: int, peer: str) -> None:
        """The calling thread starts serving a request of message type ``kind`` from ``peer``."""
        self._serving[threading.get_ident()] = (time.monotonic(), kind, peer)

    def end(self) -> None:
        self._serving.pop(threading.get_ident(), None)

    def _look(self) -> None:
        now = time.monotonic()
        for ident, (since, kind, peer) in list(self._serving.items()):
            if now - since > self.threshold_s and (ident, since) not in self._said:
                self._said.add((ident, since))
                _log.warning(
                    "kvharbor: a %s request from %s has been served for %.1f s, past half of "
                    "gateway.request_timeout_ms (its client gives up at the whole); the gateway's threads:\n%s",
                    _type_name(kind), peer, now - since, _stacks(),
                )  # fmt: skip
        self._said = {said for said in self._said if self._serving.get(said[0], (None,))[0] == said[1]}


def _type_name(kind: int) -> str:
    try:
        return p.MessageType(kind).name
    except ValueError:
        return f"type-{kind}"


def _stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )
