"""`Periodic`: one function called every interval on a daemon thread of its own, until stopped.

The gateway's background work (the tier prober, the request watchdog) and the
dashboard's history sampler are each such a loop; this is its one lifecycle:
`start` returns the object, `stop` waits for the call in progress (and is safe
twice or before `start`), and a call that raises is logged with its traceback
and the loop goes on (one bad round must not end the background work for good).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Self

from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.periodic")


class Periodic:
    def __init__(self, name: str, interval_s: float, tick: Callable[[], None]) -> None:
        """``tick`` runs every ``interval_s`` (the first time one interval after `start`) on a
        daemon thread called ``name``; a long tick delays the next, never overlaps it."""
        if not interval_s > 0:
            raise ValueError(f"{name}: the interval must be > 0 s, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self._tick = tick
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    @property
    def stopping(self) -> bool:
        """True once `stop` was called: a long tick may end early."""
        return self._stopping.is_set()

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the tick in progress; safe to call twice, or before `start`."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self._tick()
            except Exception:
                _log.exception("kvharbor: %s: unexpected error; it runs again in %g s", self.name, self.interval_s)
