"""The card's clock: virtual time, or real time scaled, both over one SimPy environment.

Operations do not queue as SimPy processes: their completion times are computed
(see `channels`), and the caller then waits for that time on the clock. What
SimPy's event loop runs are the card's *scheduled* changes (a remote target's
unavailability windows, a scenario's timed faults), as processes on `env`; each
clock runs the events that are due before an operation looks at the card.

- `VirtualClock`: time moves only when an operation completes, at once: as fast
  as the host can compute (the planner, property tests, benchmarks).
- `ScaledClock`: card time follows the wall clock divided by ``time_scale``, and
  waiting sleeps, so that a real gateway sees the card's latencies (scaled).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Generator

import simpy


class CardClock(ABC):
    def __init__(self) -> None:
        self.env = simpy.Environment()
        self._next_due = self.env.peek()
        self._lock = threading.Lock()

    @abstractmethod
    def now(self) -> float:
        """Card time in seconds since the card was made."""

    @abstractmethod
    def wait(self, until_s: float) -> None:
        """Return when card time has reached ``until_s`` (an operation's completion)."""

    def tick(self) -> float:
        """Run the scheduled events due by now, so that the card's state is that of now;
        returns now.

        SimPy's own time moves only by these steps; processes therefore wait for
        absolute card times (``env.timeout(at_s - env.now)``), see `card`.
        """
        now = self.now()
        if self._next_due <= now:  # The common case costs this one comparison.
            with self._lock:
                env = self.env
                while env.peek() <= now:
                    env.step()
                self._next_due = env.peek()
        return now

    def start(self, process: Generator[simpy.Event, None, None]) -> None:
        """Run ``process`` on the card's SimPy environment (the one way to schedule on it)."""
        with self._lock:
            self.env.process(process)
            self._next_due = self.env.peek()


class VirtualClock(CardClock):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def wait(self, until_s: float) -> None:
        # Under the lock: two callers' check-then-set could otherwise move time back.
        with self._lock:
            if until_s > self._now:
                self._now = until_s

    def advance(self, seconds: float) -> None:
        """Let card time pass with no operation running (a scenario waits)."""
        if seconds < 0:
            raise ValueError(f"advance: seconds must be >= 0 (got {seconds})")
        self._now += seconds
        self.tick()


class ScaledClock(CardClock):
    def __init__(self, time_scale: float) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale: must be > 0 (got {time_scale})")
        super().__init__()
        self.time_scale = time_scale
        self._start = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._start) / self.time_scale

    def wait(self, until_s: float) -> None:
        ahead_s = (until_s - self.now()) * self.time_scale
        if ahead_s > 0:
            time.sleep(ahead_s)
