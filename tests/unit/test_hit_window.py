"""Hit accounting's recent window: what status shows as the recent hit rate."""

from __future__ import annotations

import pytest

from kvharbor.cache.accounting import HitAccounting


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_the_recent_window_keeps_the_last_window_s_and_the_totals_everything() -> None:
    clock = Clock()
    accounting = HitAccounting(window_s=60, clock=clock)
    accounting.record(512, 0)  # A cold cache after a restart.
    clock.now_s += 30
    accounting.record(512, 256)
    assert accounting.recent() == (1024, 256)
    clock.now_s += 31  # The first lookup is now 61 s old: out of the window.
    accounting.record(512, 512)
    assert accounting.recent() == (1024, 768)
    clock.now_s += 3600
    assert accounting.recent() == (0, 0)
    assert accounting.snapshot() == {"lookups": 3, "query_tokens": 1536, "hit_tokens": 768}


def test_a_window_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0 s"):
        HitAccounting(window_s=0)
