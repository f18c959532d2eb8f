"""A circuit breaker per tier: stop asking storage that keeps failing.

A tier whose operations fail more often than ``failure_ratio`` over the last
``window`` operations is *open*: it is skipped (its lookups and gets are
misses, its puts are dropped) for ``cooldown_s``. Then one trial operation is
let through (*half-open*): success closes the breaker, failure opens it again
for ``probe_backoff_factor`` times longer than the last time, up to
``probe_interval_max_s`` (a target that restarts for minutes is probed a few
times, not every ``cooldown_s``). A device that says it is gone (`trip`) opens
the breaker at once: there is nothing to learn from a window of failures.
Skipping a sick tier is what keeps a dying disk from adding its timeouts to
every request's time to first token.

Every operation runs inside an `Attempt` (``with breaker.attempt() as attempt``).
The half-open trial belongs to one attempt; when that attempt ends without an
outcome (a miss found before storage was asked, a value the tier cannot take,
an early return of any kind), leaving the ``with`` hands the trial back. So no
path can leave the breaker half-open with a trial that never reports, which
would skip the tier until the process restarts.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType


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
    probe_backoff_factor: float = 2.0
    probe_interval_max_s: float = 300.0

    def __post_init__(self) -> None:
        if not (0 < self.failure_ratio <= 1 and self.window > 0 and self.cooldown_s > 0):
            raise ValueError(f"breaker settings out of range: {self}")
        if not (self.probe_backoff_factor >= 1 and self.probe_interval_max_s > 0):
            raise ValueError(f"breaker probe settings out of range: {self}")


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._outcomes: deque[bool] = deque(maxlen=settings.window)
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._wait_s = settings.cooldown_s
        """How long the breaker stays open this time: grows with each failed trial."""
        self._trial_running = False
        self._trials = 0
        """Trials handed out so far; an attempt knows its trial by this number."""
        self.opened_total = 0
        self._lock = threading.Lock()

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._advance()
            return self._state

    def attempt(self) -> Attempt:
        """One operation's permission, to hold in a ``with`` for the operation's length.

        Closed: allowed. Half-open: the first attempt is allowed as the trial,
        others are not until it ends. Open: not allowed. See the module docstring
        for what leaving the ``with`` does.
        """
        with self._lock:
            self._advance()
            if self._state is BreakerState.CLOSED:
                return Attempt(self, allowed=True, trial=0)
            if self._state is BreakerState.HALF_OPEN and not self._trial_running:
                self._trial_running = True
                self._trials += 1
                return Attempt(self, allowed=True, trial=self._trials)
            return Attempt(self, allowed=False, trial=0)

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

    @property
    def wait_s(self) -> float:
        """How long the breaker stays open (this time, or next time it opens)."""
        with self._lock:
            return self._wait_s

    def trip(self) -> BreakerState:
        """The device says it is gone: open now (a failed trial, if half-open); returns the state."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                self._trial_running = False
                self._open()
            return self._state

    def _end(self, trial: int) -> None:
        """An attempt ended: if it held the trial and nothing reported since, hand it back."""
        with self._lock:
            if trial and trial == self._trials and self._state is BreakerState.HALF_OPEN:
                self._trial_running = False

    def _advance(self) -> None:
        cooled = self._clock() - self._opened_at >= self._wait_s
        if self._state is BreakerState.OPEN and cooled:
            self._state = BreakerState.HALF_OPEN
            self._trial_running = False

    def _open(self) -> None:
        settings = self.settings
        if self._state is BreakerState.HALF_OPEN:  # A failed trial: wait longer before the next.
            self._wait_s = min(self._wait_s * settings.probe_backoff_factor, settings.probe_interval_max_s)
        else:
            self._wait_s = min(settings.cooldown_s, settings.probe_interval_max_s)
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self.opened_total += 1

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._outcomes.clear()
        self._failures = 0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One operation under a breaker (see `CircuitBreaker.attempt`).

    The operation's outcome is reported with `CircuitBreaker.record`; an attempt
    that ends without one, by any path, gives its trial back on leaving the
    ``with`` (or on `end`, for an attempt that spans two calls, like a
    reservation that is completed or abandoned later).
    """

    breaker: CircuitBreaker
    allowed: bool
    trial: int
    """The half-open trial this attempt holds; 0 when it holds none."""

    def end(self) -> None:
        self.breaker._end(self.trial)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.end()
