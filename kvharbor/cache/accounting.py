"""Hit accounting in tokens: what was asked for and what the cache had.

Hit rates are read against what is possible: a prompt of N tokens can hit at
most floor(N / chunk_size) x chunk_size tokens, so queries are counted in
full-chunk tokens, the same unit as hits.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class _Totals:
    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


class HitAccounting:
    def __init__(self) -> None:
        self._totals = _Totals()
        self._lock = threading.Lock()

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        assert 0 <= hit_tokens <= query_tokens, (hit_tokens, query_tokens)
        with self._lock:
            self._totals.lookups += 1
            self._totals.query_tokens += query_tokens
            self._totals.hit_tokens += hit_tokens

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return asdict(self._totals)
