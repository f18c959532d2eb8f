"""Small values in the shared RAM tier: slots of slabs instead of whole pages (`kvharbor.hal.slabs`),
and a budget, a status and metrics that count what each value really takes."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
from prometheus_client import CollectorRegistry

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.index import Entry, MemoryIndex, OverBudget
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.cache.tier import Tier
from kvharbor.gateway.collectors import StoreCollector
from kvharbor.hal.base import DeviceFull
from kvharbor.hal.extents import PAGE_BYTES, Extents, round_up
from kvharbor.hal.shm_ram import SharedRamDevice
from kvharbor.hal.slabs import SLAB_BYTES, SLOT_ALIGN_BYTES, Slabs, slot_bytes, slot_share
from kvharbor.ops.status_text import fill_text

FINGERPRINT = LayoutFingerprint(model_id="test/small-values", chunk_size=16).digest()
SMALL_VALUE_BYTES = 64
SMALL_OBJECT_BYTES = HEADER_BYTES + SMALL_VALUE_BYTES
"""4,160 bytes: what whole pages would round to 8,192."""
SMALL_SLOT_BYTES = SMALL_OBJECT_BYTES  # Already a multiple of the slot alignment.
SMALL_SHARE_BYTES = -(-SLAB_BYTES // (SLAB_BYTES // SMALL_SLOT_BYTES))
"""4,162 bytes: the slot and its part of the slab's tail."""
REGION_OFFSET = 2 * PAGE_BYTES


def region_device(region_bytes: int) -> SharedRamDevice:
    segment = memoryview(bytearray(REGION_OFFSET + region_bytes))
    return SharedRamDevice("ram", segment[REGION_OFFSET:], REGION_OFFSET, region_bytes)


def tier_of(capacity_bytes: int, region_bytes: int) -> Tier:
    device = region_device(region_bytes)
    return Tier("ram", device, MemoryIndex(), capacity_bytes, CircuitBreaker(BreakerSettings()))


def new_key() -> ChunkKey:
    return ChunkKey(os.urandom(16))


# -- where an object goes ----------------------------------------------------------------


def test_a_small_object_takes_a_slot_and_a_page_sized_one_keeps_its_pages() -> None:
    assert slot_bytes(SMALL_OBJECT_BYTES) == SMALL_SLOT_BYTES
    assert slot_share(SMALL_SLOT_BYTES) == SMALL_SHARE_BYTES
    assert slot_bytes(HEADER_BYTES + 2048) == HEADER_BYTES + 2048  # A 2 KiB page of a small model's KV.
    assert slot_bytes(HEADER_BYTES + 1) == SMALL_SLOT_BYTES  # Rounded up to a cache line.
    assert slot_bytes(0) == SLOT_ALIGN_BYTES
    for pages in (1, 2, 5, 64):
        assert slot_bytes(pages * PAGE_BYTES) is None, "a page multiple wastes nothing in pages"
    assert slot_bytes(29_000) is None, "its slot would save less than 1/8 of its 8 pages"
    assert slot_bytes(34_096) is None, "larger than a slab's slots may be"
    with pytest.raises(ValueError, match="-1 bytes"):
        slot_bytes(-1)


def test_slots_are_aligned_apart_and_slabs_go_back_to_the_region_when_empty() -> None:
    extents = Extents(4 * SLAB_BYTES)
    slabs = Slabs(extents)
    per_slab = SLAB_BYTES // SMALL_SLOT_BYTES
    offsets = [slabs.allocate(SMALL_SLOT_BYTES) for _ in range(per_slab + 1)]
    assert None not in offsets
    starts = sorted(offset for offset in offsets if offset is not None)
    assert all(offset % SLOT_ALIGN_BYTES == 0 for offset in starts)
    assert all(after - before >= SMALL_SLOT_BYTES for before, after in itertools.pairwise(starts))
    assert slabs.held_bytes == 2 * SLAB_BYTES, "one slab full, the next one begun"
    assert extents.free_bytes == 2 * SLAB_BYTES
    slabs.check()
    for offset in starts:
        assert slabs.free(offset, SMALL_SLOT_BYTES)
    slabs.check()
    assert slabs.held_bytes == 0 and extents.free_bytes == 4 * SLAB_BYTES
    extents.check()


def test_a_slot_freed_twice_or_of_another_size_is_refused_and_an_extent_is_not_a_slot() -> None:
    extents = Extents(2 * SLAB_BYTES)
    slabs = Slabs(extents)
    kept, freed = slabs.allocate(SMALL_SLOT_BYTES), slabs.allocate(SMALL_SLOT_BYTES)
    assert kept is not None and freed is not None
    assert slabs.free(freed, SMALL_SLOT_BYTES)
    with pytest.raises(ValueError, match="no slot"):
        slabs.free(freed, SMALL_SLOT_BYTES)
    with pytest.raises(ValueError, match="no slot"):
        slabs.free(kept, SMALL_SLOT_BYTES + SLOT_ALIGN_BYTES)
    page = extents.allocate(PAGE_BYTES)
    assert page is not None and not slabs.free(page, SMALL_SLOT_BYTES), "pages of the region's own"
    slabs.check()


# -- the device ----------------------------------------------------------------------------


def test_small_values_fill_the_region_at_their_slot_s_size_and_read_back_intact() -> None:
    region_bytes = 16 * SLAB_BYTES
    device = region_device(region_bytes)
    fit = region_bytes // SLAB_BYTES * (SLAB_BYTES // SMALL_SLOT_BYTES)
    assert fit > 1.9 * region_bytes // round_up(SMALL_OBJECT_BYTES), "whole pages would hold half as many"
    values = {new_key(): os.urandom(SMALL_OBJECT_BYTES) for _ in range(fit)}
    for key, value in values.items():
        device.put(key, [value[:HEADER_BYTES], value[HEADER_BYTES:]])
    for key, value in values.items():
        into = memoryview(bytearray(SMALL_OBJECT_BYTES))
        assert device.get(key, into) == SMALL_OBJECT_BYTES and bytes(into) == value
    assert device.usage().keys == fit
    assert device.allocation_bytes(SMALL_OBJECT_BYTES) == SMALL_SHARE_BYTES
    assert device.allocation_bytes(HEADER_BYTES + 30_000) == round_up(HEADER_BYTES + 30_000)


def test_a_pinned_small_value_keeps_its_slot_until_unpinned() -> None:
    device = region_device(SLAB_BYTES)
    key = new_key()
    device.put(key, [b"A" * SMALL_OBJECT_BYTES])
    span = device.pin(key)
    assert span is not None
    device.delete(key)
    others = [new_key() for _ in range(SLAB_BYTES // SMALL_SLOT_BYTES - 1)]
    for other in others:  # Every other slot of the only slab.
        device.put(other, [b"B" * SMALL_OBJECT_BYTES])
    assert bytes(device.view(span)) == b"A" * SMALL_OBJECT_BYTES, "its slot is not reused while read"
    with pytest.raises(DeviceFull):
        device.put(new_key(), [b"C" * SMALL_OBJECT_BYTES])
    device.unpin(span)
    device.put(new_key(), [b"C" * SMALL_OBJECT_BYTES])  # Now it is.


def test_a_small_value_is_never_lent_in_place_its_pages_are_shared() -> None:
    device = region_device(SLAB_BYTES)
    assert not device.writes_in_place(SMALL_OBJECT_BYTES)
    assert device.writes_in_place(HEADER_BYTES + PAGE_BYTES)
    with pytest.raises(ValueError, match="slab"):
        device.reserve(SMALL_OBJECT_BYTES)


def test_a_small_value_falls_back_to_pages_where_no_slab_fits_the_region() -> None:
    device = region_device(4 * PAGE_BYTES)
    keys = [new_key(), new_key()]
    for key in keys:
        device.put(key, [b"s" * SMALL_OBJECT_BYTES])  # Two pages each: the region holds two.
    with pytest.raises(DeviceFull):
        device.put(new_key(), [b"s" * SMALL_OBJECT_BYTES])
    for key in keys:
        assert device.delete(key)
    device.put(new_key(), [b"p" * 4 * PAGE_BYTES])  # Their pages came back.


# -- the tier: budget, status, metrics -----------------------------------------------------


def test_64_byte_values_fill_the_tier_to_its_capacity_without_eviction_then_evict_at_the_real_figure() -> None:
    capacity = 8 * SLAB_BYTES
    tier = tier_of(capacity, capacity + 2 * SLAB_BYTES)
    fit = capacity // SMALL_SHARE_BYTES
    keys = [new_key() for _ in range(fit)]
    for key in keys:
        assert tier.write(key, FINGERPRINT, os.urandom(SMALL_VALUE_BYTES))
    status = tier.status()
    assert (status.keys, status.counters.evictions, status.counters.full) == (fit, 0, 0)
    assert status.used_bytes == fit * SMALL_OBJECT_BYTES
    assert status.allocated_bytes == fit * SMALL_SHARE_BYTES
    assert capacity - SMALL_SHARE_BYTES < status.allocated_bytes <= capacity
    assert tier.write(new_key(), FINGERPRINT, os.urandom(SMALL_VALUE_BYTES))
    status = tier.status()
    assert (status.keys, status.counters.evictions) == (fit, 1), "full at the allocated figure: one evicted"
    assert tier.contains(keys[:1]) == [False], "the least recently used"
    assert status.allocated_bytes <= capacity


def test_values_in_pages_are_counted_in_pages_so_the_tier_evicts_before_its_region_overfills() -> None:
    object_bytes = HEADER_BYTES + 30_000  # 34,096 bytes in 9 pages (36,864).
    pages = round_up(object_bytes)
    capacity = 12 * object_bytes  # 12 values by their bytes, 11 by their pages.
    tier = tier_of(capacity, 12 * pages)
    for _ in range(12):
        assert tier.write(new_key(), FINGERPRINT, os.urandom(object_bytes - HEADER_BYTES))
    status = tier.status()
    assert (status.keys, status.counters.evictions, status.counters.full) == (11, 1, 0)
    assert status.allocated_bytes == 11 * pages and status.used_bytes == 11 * object_bytes


def test_a_small_value_asks_no_place_in_place_and_evicts_nothing_for_one() -> None:
    capacity = 2 * SLAB_BYTES
    tier = tier_of(capacity, capacity + SLAB_BYTES)
    for _ in range(capacity // SMALL_SHARE_BYTES):
        assert tier.write(new_key(), FINGERPRINT, os.urandom(SMALL_VALUE_BYTES))
    assert tier.reserve(new_key(), FINGERPRINT, SMALL_VALUE_BYTES, frozenset()) is None
    assert tier.status().counters.evictions == 0


def test_the_index_budget_counts_each_entry_s_slack() -> None:
    index = MemoryIndex()
    first, second = Entry(b"a" * 16, 4160, 1, slack_bytes=4032), Entry(b"b" * 16, 4160, 1, slack_bytes=4032)
    assert index.admit(first, 2 * 8192) == [] and index.admit(second, 2 * 8192) == []
    assert (index.used_bytes(), index.allocated_bytes()) == (2 * 4160, 2 * 8192)
    victims = index.admit(Entry(b"c" * 16, 100, 1), 2 * 8192)
    assert victims == [first], "4,160 bytes would fit beside the bytes, not beside the pages"
    assert index.lru(2)[0].slack_bytes == 4032
    with pytest.raises(OverBudget):
        index.admit(Entry(b"d" * 16, 4160, 1, slack_bytes=4032), 8191)
    with pytest.raises(ValueError, match="slack"):
        index.admit(Entry(b"e" * 16, 4160, 1, slack_bytes=-1), 2 * 8192)
    index.remove([b"b" * 16])
    assert (index.used_bytes(), index.allocated_bytes()) == (100, 100)


def test_status_and_metrics_show_what_the_objects_take_beside_their_bytes() -> None:
    tier = tier_of(4 * SLAB_BYTES, 5 * SLAB_BYTES)
    for _ in range(10):
        assert tier.write(new_key(), FINGERPRINT, os.urandom(SMALL_VALUE_BYTES))
    registry = CollectorRegistry()
    registry.register(StoreCollector([tier], None, 10.0))
    labels = {"tier": "ram"}
    assert registry.get_sample_value("kvharbor_tier_allocated_bytes", labels) == 10 * SMALL_SHARE_BYTES
    assert registry.get_sample_value("kvharbor_tier_used_bytes", labels) == 10 * SMALL_OBJECT_BYTES
    status = tier.status()
    assert (status.used_bytes, status.allocated_bytes) == (10 * SMALL_OBJECT_BYTES, 10 * SMALL_SHARE_BYTES)
    mib = 1 << 20
    paged = dataclasses.replace(status, capacity_bytes=512 * mib, used_bytes=100 * mib, allocated_bytes=200 * mib)
    assert fill_text(paged) == "200.0 MiB of 512.0 MiB taken (100.0 MiB in objects, +100.0% allocation)"
    exact = dataclasses.replace(paged, allocated_bytes=100 * mib)
    assert fill_text(exact) == "100.0 MiB of 512.0 MiB", "a device that adds nothing: as before"
