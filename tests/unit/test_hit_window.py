"""The recent window of lookups: what status shows as the recent hit rate."""

from __future__ import annotations

import pytest

from kvharbor.telemetry.window import RecentTokens
from tests.support.clock import Clock


def test_the_recent_window_keeps_the_last_window_s() -> None:
    clock = Clock()
    recent = RecentTokens(window_s=60, clock=clock)
    recent.record(512, 0)  # A cold cache after a restart.
    clock.now_s += 30
    recent.record(512, 256)
    assert recent.totals() == (1024, 256)
    clock.now_s += 31  # The first lookup is now 61 s old: out of the window.
    recent.record(512, 512)
    assert recent.totals() == (1024, 768)
    clock.now_s += 3600
    assert recent.totals() == (0, 0)


def test_a_window_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0 s"):
        RecentTokens(window_s=0)
