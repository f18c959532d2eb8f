"""A circuit breaker per tier: stop asking storage that keeps failing.

A tier whose operations fail more often than ``failure_ratio`` over the last
``window`` operations is *open*: it is skipped (its lookups and gets are
misses, its puts are dropped) for ``cooldown_s``. Then one trial operation is
let through (*half-open*): success closes the breaker, failure opens it again.
Skipping a sick tier is what keeps a dying disk from adding its timeouts to
every request's time to first token.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_ratio: float = 0.2
    window: int = 50
    """Operations judged together; also the fewest seen before the breaker may open."""
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        assert 0 < self.failure_ratio <= 1 and self.window > 0 and self.cooldown_s > 0, self


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._outcomes: deque[bool] = deque(maxlen=settings.window)
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._trial_running = False
        self.opened_total = 0
        self._lock = threading.Lock()

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._advance()
            return self._state

    def allow(self) -> bool:
        """May an operation run now? In half-open, only one trial at a time."""
        with self._lock:
            self._advance()
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.HALF_OPEN and not self._trial_running:
                self._trial_running = True
                return True
            return False

    def record(self, ok: bool) -> BreakerState:
        """Count one finished operation; returns the state after it."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._trial_running = False
                if ok:
                    self._close()
                else:
                    self._open()
                return self._state
            if self._state is BreakerState.OPEN:
                return self._state  # A straggler from before the breaker opened.
            if len(self._outcomes) == self._outcomes.maxlen and not self._outcomes[0]:
                self._failures -= 1
            self._outcomes.append(ok)
            if not ok:
                self._failures += 1
            assert 0 <= self._failures <= len(self._outcomes)
            full = len(self._outcomes) == self.settings.window
            if full and self._failures > self.settings.failure_ratio * self.settings.window:
                self._open()
            return self._state

    def cancel(self) -> None:
        """Forget an allowed operation that never reached storage: nothing to judge.

        In half-open this hands the one trial back, so that the next operation
        may be the trial; without it the breaker would wait forever for an
        outcome that never comes.
        """
        with self._lock:
            self._trial_running = False

    def _advance(self) -> None:
        cooled = self._clock() - self._opened_at >= self.settings.cooldown_s
        if self._state is BreakerState.OPEN and cooled:
            self._state = BreakerState.HALF_OPEN
            self._trial_running = False

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self.opened_total += 1

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._outcomes.clear()
        self._failures = 0
