"""The charts' history: samples of the store taken on the gateway's side, in a bounded ring.

The page may be opened long after the gateway started and reloaded at will, so the
figures over time are kept here, not in the browser: every
``dashboard.history_interval_s`` a `Sample` of the store's cumulative counters and
each tier's usage goes into a ring of ``dashboard.history_samples_max``. Rates
(the hit rate, evictions) are differences between neighbouring samples, so a
chart point is what happened in that interval.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvharbor.cache.store import StoreStatus
from kvharbor.periodic import Periodic


@dataclass(frozen=True, slots=True)
class TierSample:
    used_bytes: int
    capacity_bytes: int
    evictions: int
    """Cumulative, since the gateway started."""


@dataclass(frozen=True, slots=True)
class Sample:
    time_s: float
    """Seconds since the epoch."""
    lookup_tokens: int
    hit_tokens: int
    """Cumulative full-chunk tokens looked up and found, since the gateway started."""
    tiers: dict[str, TierSample]


def sample_of(status: StoreStatus, now_s: float) -> Sample:
    return Sample(
        time_s=now_s,
        lookup_tokens=status.hits.lookup_tokens,
        hit_tokens=status.hits.hit_tokens,
        tiers={
            tier.name: TierSample(tier.used_bytes, tier.capacity_bytes, tier.counters.evictions)
            for tier in status.tiers
        },
    )


class History:
    """Samples ``source`` on a thread of its own; thread-safe."""

    def __init__(self, source: Callable[[], StoreStatus], interval_s: float, samples_max: int) -> None:
        if samples_max < 2:
            raise ValueError(f"a history needs at least 2 samples to show a rate, got {samples_max}")
        self.interval_s = interval_s
        self.samples_max = samples_max
        self._source = source
        self._samples: deque[Sample] = deque(maxlen=samples_max)
        self._lock = threading.Lock()
        self._periodic = Periodic("kvharbor-dashboard-history", interval_s, self.take)

    def start(self) -> None:
        self.take()  # The page has a first point at once.
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def take(self) -> None:
        sample = sample_of(self._source(), time.time())
        with self._lock:
            self._samples.append(sample)

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def document(self) -> dict[str, Any]:
        """What ``/api/history`` answers: per interval between two samples (``t`` its end),
        the hit rate in tokens (None when nothing was looked up) and each tier's
        evictions; each tier's usage at every sample's time."""
        samples = self.samples()
        pairs = list(itertools.pairwise(samples))
        tiers = samples[-1].tiers if samples else {}

        def hit_rate(before: Sample, after: Sample) -> float | None:
            asked = after.lookup_tokens - before.lookup_tokens
            return (after.hit_tokens - before.hit_tokens) / asked if asked > 0 else None

        return {
            "interval_s": self.interval_s,
            "samples_max": self.samples_max,
            "t": [s.time_s for s in samples],
            "hit_rate": [None] + [hit_rate(a, b) for a, b in pairs] if samples else [],
            "tiers": {
                name: {
                    "capacity_bytes": tier.capacity_bytes,
                    "used_bytes": [s.tiers[name].used_bytes if name in s.tiers else None for s in samples],
                    "evictions": [None] + [_delta(a, b, name) for a, b in pairs] if samples else [],
                }
                for name, tier in tiers.items()
            },
        }


def _delta(before: Sample, after: Sample, tier: str) -> int | None:
    if tier not in before.tiers or tier not in after.tiers:
        return None
    return after.tiers[tier].evictions - before.tiers[tier].evictions
