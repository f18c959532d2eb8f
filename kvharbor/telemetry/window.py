"""A recent window of lookups in tokens: the hit rate of the last minutes, which status shows.

Prometheus computes rates over any window from the counters; `kvharbor status` has no
Prometheus behind it, and the totals of a long run hide a restart's cold cache warming up.
The last ``window_s`` seconds are kept in one-second buckets (at most ``window_s`` of them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class RecentTokens:
    def __init__(self, window_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds (monotonic; a test's own clock)."""
        if window_s <= 0:
            raise ValueError(f"the hit-rate window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._buckets: deque[list[int]] = deque()
        """[second, lookup tokens, hit tokens] per second that saw a lookup, oldest first."""
        self._lock = threading.Lock()

    def record(self, lookup_tokens: int, hit_tokens: int) -> None:
        second = int(self._clock())
        with self._lock:
            buckets = self._buckets
            if buckets and buckets[-1][0] == second:
                buckets[-1][1] += lookup_tokens
                buckets[-1][2] += hit_tokens
            else:
                buckets.append([second, lookup_tokens, hit_tokens])
                self._forget_before(second)

    def totals(self) -> tuple[int, int]:
        """(lookup tokens, hit tokens) of the last ``window_s`` seconds."""
        with self._lock:
            self._forget_before(int(self._clock()))
            return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def _forget_before(self, second: int) -> None:
        """Drop the buckets older than the window ending at ``second`` (under the lock)."""
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()
