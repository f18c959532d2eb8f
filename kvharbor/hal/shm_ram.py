"""The RAM tier inside the gateway's shared-memory segment.

Values live in a region that clients map read-only: most in page-aligned extents of their
own, small ones in slots of slabs (`kvharbor.hal.slabs`, which says why: a value of 64 bytes
would otherwise take two pages for its 4,160 bytes). A hit is served in place: the gateway
names the span, the client copies the value out (one copy; a GPU client does one DMA from
the registered segment). A put of a value in its own pages is written in place too
(`InPlaceWrites`): the gateway lends the value's final extent, the client makes just that
extent writable, fills it, and makes it read-only again before it commits; the gateway then
checksums the bytes where they stay. A value in a slab shares its pages with others, so it
is never lent (`writes_in_place`): the gateway's put copies it in from the ring and verifies
the copy. Outside that window no client can write a stored value, so a value checksummed
where it lies stays verified.

What a value takes (`allocation_bytes`) is its whole pages, or its slot's share of its slab:
the tier's budget counts that, not its bytes, so the region (the budget and a little slack,
`kvharbor.gateway.server.RAM_SLACK_DIVISOR`) holds what the budget admits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvharbor.hal.base import (
    STREAM_SLICE_BYTES,
    Buffer,
    BufferTooSmall,
    Device,
    DeviceFull,
    Health,
    HealthState,
    InPlaceWrites,
    SharedSpan,
    SliceConsumer,
    Usage,
    copy_streamed,
)
from kvharbor.hal.extents import Extents, round_up
from kvharbor.hal.keytable import NO_RECORD, KeyTable
from kvharbor.hal.slabs import SLOT_ALIGN_BYTES, Slabs, slot_bytes, slot_share

_OFFSET, _LENGTH, _PINS = range(3)
_FIELDS = "QII"
"""A stored value's record (`KeyTable` fields): where it starts in the region in bytes (a
slot lies anywhere a cache line starts), its length in bytes (`storage.value_mb_max` is
below 4 GiB), and how many readers hold it pinned. A deleted or replaced value's record is
detached from its key and freed, with its extent or slot, when its last pin goes."""


class SharedRamDevice(Device, InPlaceWrites):
    def __init__(self, name: str, region: memoryview, region_offset: int, max_value_bytes: int) -> None:
        """``region`` is this device's part of the segment, starting ``region_offset``
        bytes into it (spans are reported in segment coordinates)."""
        assert region.nbytes > 0 and region_offset >= 0
        assert max_value_bytes < 2**32, "lengths are 32 bits"
        super().__init__(name, min(max_value_bytes, region.nbytes))
        self._region = region
        self._region_offset = region_offset
        self._extents = Extents(region.nbytes)
        self._slabs = Slabs(self._extents)
        self._table = KeyTable(_FIELDS)
        self._used_bytes = 0
        self._lock = threading.Lock()

    # -- Device --------------------------------------------------------------

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        offset = self._place(total)
        if offset is None:
            raise DeviceFull(self.name, f"no room for {total} bytes ({self._extents.free_bytes} bytes of pages free)")
        at = offset
        for part in parts:
            view = memoryview(part).cast("B")
            self._region[at : at + view.nbytes] = view
            at += view.nbytes
        assert at - offset == total
        self._store(key, offset, total)

    def get(self, key: bytes, into: memoryview) -> int | None:
        return self.get_streamed(key, into, lambda _: None, max(1, into.nbytes))

    def get_streamed(
        self, key: bytes, into: memoryview, consume: SliceConsumer, slice_bytes: int = STREAM_SLICE_BYTES
    ) -> int | None:
        span = self.pin(key)  # Pinned: a concurrent replace cannot free the bytes mid-copy.
        if span is None:
            return None
        try:
            if into.nbytes < span.length:
                raise BufferTooSmall(self.name, span.length, into.nbytes)
            return copy_streamed(self.view(span), into, consume, slice_bytes)
        finally:
            self.unpin(span)

    def size(self, key: bytes) -> int | None:
        with self._lock:
            record = self._table.find(key)
            return None if record == NO_RECORD else self._table.get(record, _LENGTH)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            table = self._table
            return [key in table for key in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            record = self._table.detach(key)
            self._retire(record)
        return record != NO_RECORD

    def scan(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            table = self._table
            items = [(key, table.get(record, _LENGTH)) for key, record in table]
        yield from items

    def usage(self) -> Usage:
        return Usage(self._used_bytes, self._region.nbytes, len(self._table))

    def health(self) -> Health:
        return Health(HealthState.OK)

    def allocation_bytes(self, nbytes: int) -> int:
        slot = slot_bytes(nbytes)
        return round_up(nbytes) if slot is None else slot_share(slot)

    # -- SharedSpans ---------------------------------------------------------

    def pin(self, key: bytes) -> SharedSpan | None:
        with self._lock:
            table = self._table
            record = table.find(key)
            if record == NO_RECORD:
                return None
            table.set(record, _PINS, table.get(record, _PINS) + 1)
            offset, length = table.get(record, _OFFSET), table.get(record, _LENGTH)
        return SharedSpan(self._region_offset + offset, length, record)

    def unpin(self, span: SharedSpan) -> None:
        record = span.token
        assert isinstance(record, int)
        with self._lock:
            table = self._table
            pins = table.get(record, _PINS)
            assert pins > 0, "unpinned more often than pinned"
            table.set(record, _PINS, pins - 1)
            if pins == 1 and not table.is_live(record):
                self._free(record)

    def view(self, span: SharedSpan) -> memoryview:
        start = span.offset - self._region_offset
        return self._region[start : start + span.length]

    # -- InPlaceWrites -------------------------------------------------------

    def writes_in_place(self, nbytes: int) -> bool:
        return nbytes > 0 and slot_bytes(nbytes) is None

    def reserve(self, nbytes: int) -> SharedSpan | None:
        assert 0 < nbytes <= self.max_value_bytes, (nbytes, self.max_value_bytes)
        if not self.writes_in_place(nbytes):
            raise ValueError(f"{self.name}: a value of {nbytes} bytes lies in a slab, where no client writes")
        offset = self._extents.allocate(nbytes)
        if offset is None:
            return None
        return SharedSpan(self._region_offset + offset, nbytes, None)  # No record until adopted.

    def adopt(self, key: bytes, span: SharedSpan) -> None:
        assert span.token is None, "adopted twice, or not a reservation"
        self._store(key, span.offset - self._region_offset, span.length)

    def abandon(self, span: SharedSpan) -> None:
        assert span.token is None, "abandoned after adoption, or not a reservation"
        self._extents.free(span.offset - self._region_offset, span.length)

    # -- internals -----------------------------------------------------------

    def _place(self, nbytes: int) -> int | None:
        """Room for a value of ``nbytes``: a slot where `slot_bytes` gives one, else (or when
        the region has no room for another slab: a region smaller than one, or its free
        pages in pieces) whole pages; None when the region has neither. A value in pages
        that was counted as a slot takes less than a page more than its budget says: the
        region's slack beyond the budget covers it."""
        slot = slot_bytes(nbytes)
        offset = None if slot is None else self._slabs.allocate(slot)
        return self._extents.allocate(nbytes) if offset is None else offset

    def _unplace(self, offset: int, nbytes: int) -> None:
        """Give back what `_place` gave for ``nbytes`` at ``offset``: a slot if it lies in a
        slab, else its pages."""
        slot = slot_bytes(nbytes)
        if slot is None or not self._slabs.free(offset, slot):
            self._extents.free(offset, nbytes)

    def _store(self, key: bytes, offset: int, length: int) -> None:
        """Make the bytes at ``offset`` the value of ``key``, retiring any older value."""
        assert offset % SLOT_ALIGN_BYTES == 0, offset
        with self._lock:
            table = self._table
            self._retire(table.detach(key))
            record = table.insert(key)
            table.set(record, _OFFSET, offset)
            table.set(record, _LENGTH, length)
            self._used_bytes += length

    def _retire(self, record: int) -> None:
        """Under the lock: a value gone for new readers (detached); freed once unread."""
        if record != NO_RECORD and self._table.get(record, _PINS) == 0:
            self._free(record)

    def _free(self, record: int) -> None:
        table = self._table
        length = table.get(record, _LENGTH)
        self._unplace(table.get(record, _OFFSET), length)
        table.release(record)
        self._used_bytes -= length
        assert self._used_bytes >= 0
