"""The shared RAM tier: a pinned value survives being replaced or deleted until it is unpinned."""

from __future__ import annotations

import pytest

from kvharbor.hal.base import DeviceFull
from kvharbor.hal.extents import PAGE_BYTES
from kvharbor.hal.shm_ram import SharedRamDevice

OFFSET = 3 * PAGE_BYTES  # Where the region starts in its segment.


def make(pages: int = 8) -> tuple[SharedRamDevice, memoryview]:
    segment = memoryview(bytearray(OFFSET + pages * PAGE_BYTES))
    return SharedRamDevice("ram", segment[OFFSET:], OFFSET, pages * PAGE_BYTES), segment


def test_spans_are_in_segment_coordinates_and_hold_the_value() -> None:
    device, segment = make()
    device.put(b"k" * 16, [b"head", b"-payload"])
    span = device.pin(b"k" * 16)
    assert span is not None and span.offset >= OFFSET
    assert bytes(segment[span.offset : span.offset + span.length]) == b"head-payload"
    device.unpin(span)


def test_a_pinned_value_outlives_replace_and_delete_until_unpinned() -> None:
    device, segment = make(pages=2)
    key = b"k" * 16
    device.put(key, [b"A" * PAGE_BYTES])
    span = device.pin(key)
    assert span is not None
    device.put(key, [b"B" * PAGE_BYTES])  # The second page: the first is still pinned.
    with pytest.raises(DeviceFull):
        device.put(b"x" * 16, [b"C" * PAGE_BYTES])  # No page is free while the old value is read.
    assert bytes(segment[span.offset : span.offset + span.length]) == b"A" * PAGE_BYTES
    device.delete(key)
    assert device.pin(key) is None
    device.unpin(span)
    device.put(b"x" * 16, [b"C" * PAGE_BYTES])  # Unpinned and retired: its page is free again.
    assert device.usage().used_bytes == PAGE_BYTES


# -- writes in place -----------------------------------------------------------------


def test_a_reserved_place_is_invisible_until_adopted_and_then_replaces_the_old_value() -> None:
    device, segment = make(pages=3)
    key = b"k" * 16
    device.put(key, [b"A" * PAGE_BYTES])
    old = device.pin(key)
    assert old is not None
    place = device.reserve(PAGE_BYTES)
    assert place is not None and place.offset >= OFFSET
    segment[place.offset : place.offset + PAGE_BYTES] = b"B" * PAGE_BYTES
    assert device.size(key) == PAGE_BYTES and bytes(device.view(old)) == b"A" * PAGE_BYTES
    device.adopt(key, place)
    new = device.pin(key)
    assert new is not None and new.offset == place.offset
    assert bytes(device.view(new)) == b"B" * PAGE_BYTES
    assert bytes(device.view(old)) == b"A" * PAGE_BYTES, "a reader of the old value keeps it"
    assert device.reserve(PAGE_BYTES) is not None  # The third page.
    assert device.reserve(PAGE_BYTES) is None, "the old value's page is still pinned"
    device.unpin(old)
    assert device.reserve(PAGE_BYTES) is not None, "and is free once unpinned"
    device.unpin(new)
    assert device.usage().used_bytes == PAGE_BYTES and device.usage().keys == 1


def test_an_abandoned_place_is_free_again_and_never_seen() -> None:
    device, _ = make(pages=1)
    place = device.reserve(PAGE_BYTES)
    assert place is not None
    assert device.reserve(PAGE_BYTES) is None
    device.abandon(place)
    assert device.reserve(PAGE_BYTES) is not None
    assert device.usage().used_bytes == 0 and list(device.scan()) == []
