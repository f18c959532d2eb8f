"""The RAM tier inside the gateway's shared-memory segment.

Values live in page-aligned extents of a region that clients map read-only.
A hit is then served in place: the gateway names the span, the client copies
the value out (one copy; a GPU client does one DMA from the registered
segment). A put is written in place too (`InPlaceWrites`): the gateway lends
the value's final extent, the client makes just that extent writable, fills
it, and makes it read-only again before it commits; the gateway then
checksums the bytes where they stay. Outside that window no client can write
a stored value, so a value checksummed where it lies stays verified.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
from kvharbor.hal.extents import Extents


@dataclass(slots=True)
class _Object:
    offset: int
    """Within the region (not the segment)."""
    length: int
    pins: int = 0
    retired: bool = False
    """Deleted or replaced; its extent is freed when the last pin goes."""


class SharedRamDevice(Device, InPlaceWrites):
    def __init__(self, name: str, region: memoryview, region_offset: int, max_value_bytes: int) -> None:
        """``region`` is this device's part of the segment, starting ``region_offset``
        bytes into it (spans are reported in segment coordinates)."""
        assert region.nbytes > 0 and region_offset >= 0
        super().__init__(name, min(max_value_bytes, region.nbytes))
        self._region = region
        self._region_offset = region_offset
        self._extents = Extents(region.nbytes)
        self._objects: dict[bytes, _Object] = {}
        self._used_bytes = 0
        self._lock = threading.Lock()

    # -- Device --------------------------------------------------------------

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        offset = self._extents.allocate(total)
        if offset is None:
            raise DeviceFull(self.name, f"no extent of {total} bytes free ({self._extents.free_bytes} bytes free)")
        at = offset
        for part in parts:
            view = memoryview(part).cast("B")
            self._region[at : at + view.nbytes] = view
            at += view.nbytes
        assert at - offset == total
        with self._lock:
            self._retire(self._objects.get(key))
            self._objects[bytes(key)] = _Object(offset, total)
            self._used_bytes += total

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
        found = self._objects.get(key)
        return None if found is None else found.length

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        objects = self._objects
        return [k in objects for k in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            found = self._objects.pop(key, None)
            self._retire(found)
        return found is not None

    def scan(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            items = [(k, o.length) for k, o in self._objects.items()]
        yield from items

    def usage(self) -> Usage:
        return Usage(self._used_bytes, self._region.nbytes, len(self._objects))

    def health(self) -> Health:
        return Health(HealthState.OK)

    def close(self) -> None:
        with self._lock:
            self._objects.clear()

    # -- SharedSpans ---------------------------------------------------------

    def pin(self, key: bytes) -> SharedSpan | None:
        with self._lock:
            found = self._objects.get(key)
            if found is None:
                return None
            found.pins += 1
        return SharedSpan(self._region_offset + found.offset, found.length, found)

    def unpin(self, span: SharedSpan) -> None:
        found = span.token
        assert isinstance(found, _Object)
        with self._lock:
            assert found.pins > 0, "unpinned more often than pinned"
            found.pins -= 1
            if found.retired and found.pins == 0:
                self._free(found)

    def view(self, span: SharedSpan) -> memoryview:
        start = span.offset - self._region_offset
        return self._region[start : start + span.length]

    # -- InPlaceWrites -------------------------------------------------------

    def reserve(self, nbytes: int) -> SharedSpan | None:
        assert 0 < nbytes <= self.max_value_bytes, (nbytes, self.max_value_bytes)
        offset = self._extents.allocate(nbytes)
        if offset is None:
            return None
        return SharedSpan(self._region_offset + offset, nbytes, _Object(offset, nbytes))

    def adopt(self, key: bytes, span: SharedSpan) -> None:
        found = span.token
        assert isinstance(found, _Object) and found.pins == 0 and not found.retired, found
        with self._lock:
            self._retire(self._objects.get(key))
            self._objects[bytes(key)] = found
            self._used_bytes += found.length

    def abandon(self, span: SharedSpan) -> None:
        found = span.token
        assert isinstance(found, _Object) and found.pins == 0 and not found.retired, found
        self._extents.free(found.offset)

    # -- internals -----------------------------------------------------------

    def _retire(self, found: _Object | None) -> None:
        """Under the lock: the object is gone for new readers; free it once unread."""
        if found is None:
            return
        found.retired = True
        if found.pins == 0:
            self._free(found)

    def _free(self, found: _Object) -> None:
        self._extents.free(found.offset)
        self._used_bytes -= found.length
        assert self._used_bytes >= 0
