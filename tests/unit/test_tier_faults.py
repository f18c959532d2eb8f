"""A failing index (a damaged or locked manifest) is a fault like any other: misses, never exceptions."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.index import Entry, MemoryIndex, OverBudget, TierIndex
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.tier import Tier
from kvharbor.hal.base import DeviceCorrupt, DeviceUnavailable
from kvharbor.hal.ram import RamDevice

FINGERPRINT = LayoutFingerprint("m", 16).digest()


class BrokenIndex(MemoryIndex):
    """A real MemoryIndex whose every call fails once ``broken`` is set, as a locked manifest does."""

    def __init__(self, error: type[Exception] = DeviceUnavailable) -> None:
        super().__init__()
        self.broken = False
        self.error = error

    def _check(self) -> None:
        if self.broken:
            raise self.error("index", "database is locked")

    def admit(
        self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes] = frozenset(), behind: bool = False
    ) -> list[Entry]:
        self._check()
        return super().admit(entry, budget_bytes, pinned, behind)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check()
        return super().contains(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._check()
        super().touch(keys)

    def remove(self, keys: Sequence[bytes]) -> None:
        self._check()
        super().remove(keys)

    def used_bytes(self) -> int:
        self._check()
        return super().used_bytes()


def make_tier(index: TierIndex, reopen: TierIndex | None = None) -> Tier:
    breaker = CircuitBreaker(BreakerSettings(failure_ratio=0.5, window=4, cooldown_s=60))
    return Tier(
        "t", RamDevice("t", 1 << 20), index, 1 << 20, breaker, reopen_index=(lambda: reopen) if reopen else None
    )


def test_a_failing_index_gives_misses_and_refused_writes_never_exceptions() -> None:
    index = BrokenIndex()
    tier = make_tier(index)
    key = os.urandom(16)
    assert tier.write(key, FINGERPRINT, b"x" * 100)
    index.broken = True
    assert tier.contains([key]) == [False]
    assert not tier.write(os.urandom(16), FINGERPRINT, b"y" * 100)
    assert tier.read(key, FINGERPRINT) is not None  # The device still answers; touching failed quietly.
    assert tier.status().used_bytes == -1
    assert tier.counters.errors >= 3


def test_a_damaged_index_is_replaced_by_a_rebuilt_one() -> None:
    index = BrokenIndex(DeviceCorrupt)
    fresh = MemoryIndex()
    tier = make_tier(index, reopen=fresh)
    index.broken = True
    assert tier.contains([os.urandom(16)]) == [False]
    assert tier.index is fresh
    key = os.urandom(16)
    assert tier.write(key, FINGERPRINT, b"z" * 10)
    assert tier.contains([key]) == [True]


def test_memory_index_refuses_when_pinned_entries_leave_no_room_and_changes_nothing() -> None:
    index = MemoryIndex()
    a, b = Entry(b"a" * 16, 60, 1), Entry(b"b" * 16, 30, 1)
    index.admit(a, 100)
    index.admit(b, 100)
    with pytest.raises(OverBudget):
        index.admit(Entry(b"c" * 16, 50, 1), 100, pinned=frozenset({a.key}))
    assert index.contains([a.key, b.key, b"c" * 16]) == [True, True, False]
    assert index.used_bytes() == 90
    victims = index.admit(Entry(b"c" * 16, 40, 1), 100, pinned=frozenset({a.key}))
    assert victims == [b]
    assert index.used_bytes() == 100
