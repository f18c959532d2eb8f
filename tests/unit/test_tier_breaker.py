"""Every way a tier operation can end reports to its breaker or hands the half-open trial back.

A half-open breaker lets one trial through. An operation that ends without an
outcome (a miss the device never judged, a value this tier does not serve in
place, a write raced by another writer) must give the trial back, else the tier
is skipped until the process restarts. Each case drives one such exit through a
real tier on a real device, then checks that the next operation is the trial.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest

from kvharbor.cache.breaker import BreakerSettings, BreakerState, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES, Codec
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.tier import Tier
from kvharbor.hal.base import Buffer
from kvharbor.hal.extents import PAGE_BYTES
from kvharbor.hal.ram import RamDevice
from kvharbor.hal.shm_ram import SharedRamDevice

FINGERPRINT = LayoutFingerprint(model_id="test/breaker-exits", chunk_size=16).digest()
SETTINGS = BreakerSettings(failure_ratio=0.5, window=4, cooldown_s=10.0)
PAGES = 8
OBJECT_MAX_BYTES = HEADER_BYTES + PAGE_BYTES
"""The devices' largest object: a header and a page of payload."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RacedSharedRam(SharedRamDevice):
    """Shared RAM where another writer evicts each value right after it lands, as a
    racing client's put can between a tier's write and its verification."""

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        super().put(key, parts)
        self.delete(key)


def half_open(
    device_type: type[SharedRamDevice] | None = None, codec: Codec = Codec.NONE, stored: bytes = b""
) -> tuple[Tier, bytes]:
    """A tier holding ``stored`` (if any) under a fresh key, whose breaker has since
    opened and cooled down: the next operation is its trial. Returns the tier and the key."""
    clock = Clock()
    if device_type is None:
        device: RamDevice | SharedRamDevice = RamDevice("t", PAGES * PAGE_BYTES, OBJECT_MAX_BYTES)
    else:
        device = device_type("t", memoryview(bytearray(PAGES * PAGE_BYTES)), 0, OBJECT_MAX_BYTES)
    breaker = CircuitBreaker(SETTINGS, clock=clock)
    tier = Tier("t", device, MemoryIndex(), PAGES * PAGE_BYTES, breaker, codec)
    key = os.urandom(16)
    if stored:
        assert tier.write(key, FINGERPRINT, stored)
    for _ in range(SETTINGS.window):
        breaker.record(False)
    clock.now += SETTINGS.cooldown_s
    assert breaker.state is BreakerState.HALF_OPEN
    return tier, key


def read_raced_by_a_larger_rewrite(tier: Tier, key: bytes) -> None:
    """`Tier.read` ends in `BufferTooSmall`: the value grew between its size and its read."""

    def source(nbytes: int) -> memoryview:
        tier.device.put(key, [b"y" * (nbytes + 1000)])  # Another process rewrites it larger meanwhile.
        return memoryview(bytearray(nbytes))

    assert tier.read(key, FINGERPRINT, source) is None


def read_shared_declined(tier: Tier, key: bytes) -> None:
    """`Tier.read_shared` finds a compressed or fragmented value: `read` serves it instead."""
    assert tier.read_shared(key, FINGERPRINT) is None


def write_raced_before_verification(tier: Tier, key: bytes) -> None:
    """`Tier.write` finds nothing pinned when it verifies the shared copy."""
    assert not tier.write(key, FINGERPRINT, os.urandom(1000))


def write_unstorable(tier: Tier, key: bytes) -> None:
    """A value larger than the tier's budget never reaches the device."""
    assert not tier.write(key, FINGERPRINT, os.urandom(PAGES * PAGE_BYTES + 1))


def reserve_abandoned(tier: Tier, key: bytes) -> None:
    reservation = tier.reserve(key, FINGERPRINT, OBJECT_MAX_BYTES - HEADER_BYTES, frozenset())
    assert reservation is not None
    tier.abandon(reservation)


CASES: dict[str, tuple[Callable[[], tuple[Tier, bytes]], Callable[[Tier, bytes], None]]] = {
    "read-buffer-too-small": (lambda: half_open(stored=b"x" * 100), read_raced_by_a_larger_rewrite),
    "read-shared-compressed": (
        lambda: half_open(SharedRamDevice, Codec.LZ4, stored=b"z" * 2000),
        read_shared_declined,
    ),
    "read-shared-fragmented": (
        lambda: half_open(SharedRamDevice, stored=os.urandom(2 * PAGE_BYTES)),
        read_shared_declined,
    ),
    "write-verify-nothing-pinned": (lambda: half_open(RacedSharedRam), write_raced_before_verification),
    "write-unstorable": (half_open, write_unstorable),
    "reserve-abandoned": (lambda: half_open(SharedRamDevice), reserve_abandoned),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_exit_without_an_outcome_hands_the_trial_back(case: str) -> None:
    make, exit_without_outcome = CASES[case]
    tier, key = make()
    exit_without_outcome(tier, key)
    assert tier.breaker.state is BreakerState.HALF_OPEN
    with tier.breaker.attempt() as next_one:
        assert next_one.allowed, f"{case}: the trial leaked; the tier would be skipped until a restart"
