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
