"""Hit accounting in tokens: what was asked for and what the cache had.

Hit rates are read against what is possible: a prompt of N tokens can hit at
most floor(N / chunk_size) x chunk_size tokens, so queries are counted in
full-chunk tokens, the same unit as hits.

Besides the totals since start, the last ``window_s`` seconds are kept in
one-second buckets (at most ``window_s`` of them): a recent hit rate that shows
a restart's cold cache warming up, which the totals of a long run hide.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class _Totals:
    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


class HitAccounting:
    def __init__(self, window_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, for the recent window (monotonic; a test's own clock)."""
        if window_s <= 0:
            raise ValueError(f"the hit-rate window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._totals = _Totals()
        self._recent: deque[list[int]] = deque()
        """[second, query tokens, hit tokens] per second that saw a lookup, oldest first."""
        self._lock = threading.Lock()

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        assert 0 <= hit_tokens <= query_tokens, (hit_tokens, query_tokens)
        second = int(self._clock())
        with self._lock:
            self._totals.lookups += 1
            self._totals.query_tokens += query_tokens
            self._totals.hit_tokens += hit_tokens
            recent = self._recent
            if recent and recent[-1][0] == second:
                recent[-1][1] += query_tokens
                recent[-1][2] += hit_tokens
            else:
                recent.append([second, query_tokens, hit_tokens])
                self._forget_before(second)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return asdict(self._totals)

    def recent(self) -> tuple[int, int]:
        """(query tokens, hit tokens) of the last ``window_s`` seconds."""
        with self._lock:
            self._forget_before(int(self._clock()))
            return sum(b[1] for b in self._recent), sum(b[2] for b in self._recent)

    def _forget_before(self, second: int) -> None:
        """Drop the buckets older than the window ending at ``second`` (under the lock)."""
        while self._recent and self._recent[0][0] <= second - self.window_s:
            self._recent.popleft()
