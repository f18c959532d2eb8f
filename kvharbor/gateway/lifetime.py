"""How long an embedded gateway lives: as long as it has clients, then ``gateway.linger_s``.

An embedded gateway is started by the first engine on a host, but its life is
decided by its clients, not by that engine: when its last client detaches it
keeps serving, RAM tier intact, for ``linger_s``, so that an engine restarted
within that window restores from RAM; a client that attaches in the window
cancels the countdown. A gateway that never gets a client ends after
``linger_s`` too. Then the gateway stops: it removes its segment and socket.

A client counts as detached only once its connection's thread has finished
its last request, so every put it sent before it went away (however it died)
is committed before the countdown starts; the countdown's end then stops the
gateway the usual way, waiting up to ``gateway.stop_timeout_ms`` for requests
in flight.

A gateway with no clients also stops at once when asked to step aside (a
client of another release greets it, or its segment was removed by hand):
nothing is lost, and the new engine starts a gateway of its own. Once a
gateway has decided to stop, it admits no new client: a HELLO racing with
the end of the countdown is told to wait for the exit and start anew.

A lingering gateway does not outlive its container: it is still a process of
the container's PID namespace, which the runtime kills when the container
stops. In containers use a sidecar or a service-mode gateway.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")


class Lifetime:
    """Counts a gateway's clients and calls ``stop`` once it has been idle ``linger_s``
    (or asked to step aside). Thread-safe; ``stop`` runs on the lifetime's own thread,
    never on a client's (a gateway's stop joins the client threads)."""

    def __init__(self, linger_s: float, stop: Callable[[], None]) -> None:
        if not linger_s > 0:
            raise ValueError(f"linger_s must be positive, got {linger_s}: 0 means no lifetime at all")
        self.linger_s = linger_s
        self._stop = stop
        self._cond = threading.Condition()
        self._clients = 0
        self._deadline: float | None = None
        """When the idle gateway stops; None while it has clients (or before `start`)."""
        self._lingering = False
        """True once a last client detached, until the next one attaches."""
        self._ending = False
        """Decided: the gateway stops; no client is admitted any more."""
        self._told = False
        """The client it steps aside for has its answer: stop now."""
        self._closed = False
        """The gateway stops for another reason (a signal): the thread just ends."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvharbor-lifetime")

    def start(self) -> None:
        """Start the countdown once the gateway serves (a gateway that never gets a client
        still ends): not before, or a slow start (a large segment) would eat into it."""
        with self._cond:
            if self._clients == 0:
                self._deadline = time.monotonic() + self.linger_s
        self._thread.start()

    @property
    def clients(self) -> int:
        with self._cond:
            return self._clients

    def attach(self) -> bool:
        """A client completed its HELLO. False: the gateway is stopping; refuse it."""
        with self._cond:
            if self._ending:
                return False
            self._clients += 1
            self._deadline = None
            if self._lingering:
                self._lingering = False
                _log.info("kvharbor: a client attached to a lingering gateway; it serves on")
            return True

    def detach(self) -> None:
        """A client that attached has gone, its requests finished."""
        with self._cond:
            if self._clients <= 0:
                raise RuntimeError("a client detached that never attached")
            self._clients -= 1
            if self._clients == 0 and not self._ending:
                self._lingering = True
                self._deadline = time.monotonic() + self.linger_s
                _log.info(
                    "kvharbor: last client detached; lingering %g s (gateway.linger_s) for an engine to attach",
                    self.linger_s,
                )
                self._cond.notify_all()

    def step_aside(self, why: str) -> bool:
        """Decide to stop if no client is attached; True if so. The caller tells its
        client, then calls `told`: stopping hangs up on every connection, its own too."""
        with self._cond:
            if self._ending:
                return True
            if self._clients:
                return False
            self._ending = True
            self._deadline = None  # Its client is told first; `told` stops it.
            _log.warning("kvharbor: embedded gateway with no clients steps aside: %s; stopping", why)
            return True

    def told(self) -> None:
        """The client refused with STEPPING_ASIDE has its answer: stop now."""
        with self._cond:
            self._told = True
            self._cond.notify_all()

    def close(self) -> None:
        """The gateway stops for another reason: end the countdown without calling ``stop``."""
        with self._cond:
            self._closed = True
            self._ending = True
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not (self._closed or self._told):
                if self._deadline is None:
                    self._cond.wait()  # Clients attached, or a client to be told first.
                    continue
                left_s = self._deadline - time.monotonic()
                if left_s <= 0:
                    self._ending = True
                    _log.info("kvharbor: embedded gateway idle for %g s (gateway.linger_s); stopping", self.linger_s)
                    break
                self._cond.wait(left_s)
            if self._closed:
                return
        self._stop()
