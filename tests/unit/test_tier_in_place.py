"""Values written in place: a shared RAM tier lends a value's final place, the writer
fills it, and the tier checksums and stores it there (`Tier.reserve` / `complete`)."""

from __future__ import annotations

import os

import pytest

from kvharbor.cache.breaker import BreakerSettings, BreakerState, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES, Codec
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Reservation, Tier
from kvharbor.hal.checksum import COPY_SLICE_BYTES, checksum, copy_with_checksum
from kvharbor.hal.extents import PAGE_BYTES
from kvharbor.hal.ram import RamDevice
from kvharbor.hal.shm_ram import SharedRamDevice

FINGERPRINT = LayoutFingerprint(model_id="test/in-place", chunk_size=16).digest()
OBJECT_BYTES = HEADER_BYTES + PAGE_BYTES
"""One value's room: its header's pages and one page of payload."""
VALUE_BYTES = OBJECT_BYTES - HEADER_BYTES
REGION_OFFSET = 2 * PAGE_BYTES


def shared_tier(objects: int = 8, capacity_objects: int | None = None, codec: Codec = Codec.NONE) -> Tier:
    """A shared RAM tier over room for ``objects`` values in a segment; its budget is
    ``capacity_objects`` values."""
    segment = memoryview(bytearray(REGION_OFFSET + objects * OBJECT_BYTES))
    device = SharedRamDevice("ram", segment[REGION_OFFSET:], REGION_OFFSET, objects * OBJECT_BYTES)
    capacity = (capacity_objects or objects) * OBJECT_BYTES
    return Tier("ram", device, MemoryIndex(), capacity, CircuitBreaker(BreakerSettings()), codec)


def private_tier(name: str) -> Tier:
    """A RAM tier in this process's own memory: not shared, so nothing is lent in place."""
    return Tier(name, RamDevice(name, 8 * PAGE_BYTES), MemoryIndex(), 8 * PAGE_BYTES, CircuitBreaker(BreakerSettings()))


def write(tier: Tier, key: bytes, value: bytes, pinned: frozenset[bytes] = frozenset()) -> bool:
    reservation = tier.reserve(key, FINGERPRINT, len(value), pinned)
    assert reservation is not None
    reservation.payload[:] = value
    return tier.complete(reservation, pinned)


def new_key() -> ChunkKey:
    return ChunkKey(os.urandom(16))


def test_a_value_written_in_place_reads_back_verified_from_where_it_was_written() -> None:
    tier = shared_tier()
    key, value = new_key(), os.urandom(VALUE_BYTES)
    reservation = tier.reserve(key, FINGERPRINT, VALUE_BYTES, frozenset())
    assert reservation is not None
    assert tier.contains([key]) == [False], "invisible until completed"
    reservation.payload[:] = value
    assert tier.complete(reservation)
    hit = tier.read_shared(key, FINGERPRINT)
    assert hit is not None and hit.offset == reservation.payload_offset
    hit.release()
    got = tier.read(key, FINGERPRINT)  # The full read verifies the payload checksum.
    assert got is not None and bytes(got) == value
    assert tier.counters.puts == 1 and tier.counters.corrupt == 0


def test_the_checksum_covers_the_bytes_where_they_stay() -> None:
    tier = shared_tier()
    key = new_key()
    reservation = tier.reserve(key, FINGERPRINT, VALUE_BYTES, frozenset())
    assert reservation is not None
    reservation.payload[:] = os.urandom(VALUE_BYTES)
    assert tier.complete(reservation)
    reservation.payload[5] ^= 0x01  # Damage after the commit.
    assert tier.read(key, FINGERPRINT) is None
    assert tier.counters.corrupt == 1 and tier.contains([key]) == [False]


def test_room_for_a_reservation_comes_from_the_least_recent_unpinned_values() -> None:
    # The device holds four values; its budget would hold more, so only the device is full.
    tier = shared_tier(objects=4, capacity_objects=8)
    keys = [new_key() for _ in range(4)]
    for key in keys:
        assert write(tier, key, os.urandom(VALUE_BYTES))
    tier.touch([keys[0]])  # keys[1] is now the least recent, then keys[2].
    fresh = new_key()
    assert write(tier, fresh, os.urandom(VALUE_BYTES), pinned=frozenset({keys[1]}))
    assert tier.contains([*keys, fresh]) == [True, True, False, True, True]
    assert tier.counters.evictions == 1


def test_an_abandoned_reservation_gives_its_room_back() -> None:
    tier = shared_tier(objects=1)
    reservation = tier.reserve(new_key(), FINGERPRINT, VALUE_BYTES, frozenset())
    assert reservation is not None
    assert tier.reserve(new_key(), FINGERPRINT, VALUE_BYTES, frozenset()) is None, "all its room, lent"
    tier.abandon(reservation)
    assert write(tier, new_key(), os.urandom(VALUE_BYTES))
    assert tier.device.usage().used_bytes == OBJECT_BYTES


@pytest.mark.parametrize(
    ("tier", "nbytes"),
    [
        (shared_tier(codec=Codec.LZ4), VALUE_BYTES),  # Encoded values are written by the tier.
        (shared_tier(objects=2), 2 * OBJECT_BYTES),  # Larger than the device's largest value.
        (private_tier("ram"), VALUE_BYTES),  # Not a shared-memory device.
    ],
    ids=["codec", "too-large", "not-shared"],
)
def test_no_reservation_where_a_value_cannot_be_written_in_place(tier: Tier, nbytes: int) -> None:
    assert tier.reserve(new_key(), FINGERPRINT, nbytes, frozenset()) is None


def test_no_reservation_while_the_breaker_is_open() -> None:
    tier = shared_tier()
    for _ in range(tier.breaker.settings.window):
        tier.breaker.record(False)  # Every operation failed: the breaker opens.
    assert tier.breaker.state is BreakerState.OPEN
    assert tier.reserve(new_key(), FINGERPRINT, VALUE_BYTES, frozenset()) is None


def test_write_through_copies_a_value_written_in_place_to_the_tiers_below() -> None:
    upper = shared_tier()
    lower = private_tier("lower")
    store = TieredStore([upper, lower], "write_through")
    key, value = new_key(), os.urandom(VALUE_BYTES)
    reservation = store.reserve(key, FINGERPRINT, VALUE_BYTES)
    assert isinstance(reservation, Reservation)
    reservation.payload[:] = value
    assert store.complete(reservation)
    for tier in (upper, lower):
        got = tier.read(key, FINGERPRINT)
        assert got is not None and bytes(got) == value, tier.name


def test_the_writers_checksum_is_the_one_stored_and_a_verified_read_checks_it() -> None:
    tier = shared_tier()
    good, bad = new_key(), new_key()
    for key, lie in ((good, 0), (bad, 1)):
        value = os.urandom(VALUE_BYTES)
        reservation = tier.reserve(key, FINGERPRINT, VALUE_BYTES, frozenset())
        assert reservation is not None
        taken = copy_with_checksum(value, reservation.payload)
        assert taken == checksum(value) and bytes(reservation.payload) == value
        assert tier.complete(reservation, value_checksum=taken ^ lie)
    assert tier.read(good, FINGERPRINT) is not None
    assert tier.read(bad, FINGERPRINT) is None, "a checksum that disagrees with the bytes is a miss"
    assert tier.counters.corrupt == 1


@pytest.mark.parametrize("nbytes", [1, 4095, COPY_SLICE_BYTES, COPY_SLICE_BYTES + 1, 3 * COPY_SLICE_BYTES - 7])
def test_copy_with_checksum_copies_and_hashes_every_byte(nbytes: int) -> None:
    value = os.urandom(nbytes)
    into = memoryview(bytearray(nbytes))
    assert copy_with_checksum(value, into) == checksum(value)
    assert bytes(into) == value


def test_room_is_found_past_a_long_run_of_pinned_least_recent_values() -> None:
    tier = shared_tier(objects=20, capacity_objects=40)
    keys = [new_key() for _ in range(20)]
    for key in keys:
        assert write(tier, key, os.urandom(VALUE_BYTES))
    pinned = frozenset(keys[:17])  # More than the first look at the least recent.
    assert write(tier, new_key(), os.urandom(VALUE_BYTES), pinned=pinned)
    assert tier.contains(keys) == [True] * 17 + [False, True, True]


def test_a_run_of_in_place_hits_stops_at_the_first_value_it_cannot_serve() -> None:
    segment = memoryview(bytearray(REGION_OFFSET + 8 * OBJECT_BYTES))
    device = SharedRamDevice("ram", segment[REGION_OFFSET:], REGION_OFFSET, 8 * OBJECT_BYTES)
    tier = Tier("ram", device, MemoryIndex(), 8 * OBJECT_BYTES, CircuitBreaker(BreakerSettings()))
    store = TieredStore([tier])
    keys = [new_key() for _ in range(4)]
    values = [os.urandom(VALUE_BYTES) for _ in keys]
    for key, value in zip(keys, values, strict=True):
        assert write(tier, key, value)
    third = tier.read_shared(keys[2], FINGERPRINT)
    assert third is not None
    third.release()
    segment[third.offset - HEADER_BYTES + 8] ^= 0xFF  # Its header damaged in place.

    hits = store.get_shared_run([*keys, new_key()], FINGERPRINT)
    assert [bytes(segment[hit.offset : hit.offset + hit.length]) for hit in hits] == values[:2]
    # Each value of the run counted a hit (and the single read above one); the damaged one
    # is counted and dropped, and the run ends there, however many stored keys follow.
    assert (tier.counters.hits, tier.counters.corrupt) == (3, 1)
    assert tier.contains(keys) == [True, True, False, True]
    for hit in hits:
        hit.release()
    assert store.get_shared_run([new_key(), keys[0]], FINGERPRINT) == []  # The first key must be held.
