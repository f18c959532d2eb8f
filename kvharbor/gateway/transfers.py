"""Transfers: values moved between the shared-memory segment and the store, in batches.

A put batch lends the client one extent per value it must copy in (values
already stored, or with no room by the request's deadline, get `SKIP`); its
commit stores them from the segment, in place, and gives the room back. A get
batch reads the leading hits into extents the client copies out of; its
release gives the room back. A batch belongs to one connection: the gateway
frees what a connection still holds when it closes.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import SharedHit
from kvharbor.config import MIB, Config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.shm import Segment
from kvharbor.hal.extents import Extents

Progress = Callable[[int], None]
"""Told how many items of a long request are done, so the client hears from it."""
Count = Callable[..., None]
"""Adds to the gateway's counters: ``count(ring_full=1)``."""


class _RingFull(Exception):
    pass


@dataclass(slots=True)
class Batch:
    """Extents of the segment lent to one client for one transfer."""

    kind: str
    """"put" or "get"."""
    extents: list[int] = field(default_factory=list)
    shared: list[SharedHit] = field(default_factory=list)
    """get: values served in place from a shared-memory RAM tier, pinned until release."""
    items: list[tuple[bytes, int, int]] = field(default_factory=list)
    """put: (key, offset, length) of each value to store."""
    fingerprint: bytes = b""


class Transfers:
    def __init__(self, config: Config, store: TieredStore, segment: Segment, ring_bytes: int, count: Count) -> None:
        assert 0 < ring_bytes <= segment.size
        self.store = store
        self.segment = segment
        self.ring = Extents(ring_bytes)  # The segment's head; RAM tiers own the rest.
        self._count = count
        self._ring_wait_s = config.gateway.ring_wait_ms / 1000
        self._value_max = config.storage.value_mb_max * MIB
        self._segment_address = _address(segment.view)
        self._batch_ids = iter(range(1, 2**63))
        self._batch_lock = threading.Lock()
        self.pinned = 0
        """RAM-tier values clients are reading in place right now."""

    # -- puts ----------------------------------------------------------------

    def prepare_put(self, message: p.PutPrepare, progress: Progress) -> tuple[int, Batch, list[int]]:
        """Room for each value not yet stored; `SKIP` for the rest (stored, or no room)."""
        for _, size in message.items:
            if not 0 < size <= self._value_max:
                raise p.ProtocolError(
                    p.ErrorCode.TOO_LARGE,
                    f"value of {size} bytes is outside 1..{self._value_max} (storage.value_mb_max)",
                )
        batch = Batch("put", fingerprint=message.fingerprint)
        deadline = self._deadline()
        present = self.store.contains([key for key, _ in message.items])
        offsets = []
        no_room = 0
        try:
            for (key, size), stored in zip(message.items, present, strict=True):
                offset = None if stored else self.ring.allocate(size, deadline)
                if offset is None:
                    no_room += not stored
                    offsets.append(p.SKIP)
                    continue
                batch.extents.append(offset)
                batch.items.append((key, offset, size))
                offsets.append(offset)
                progress(len(offsets))
        except BaseException:
            self.free(batch)
            raise
        if no_room:
            self._count(ring_full=no_room)
        assert len(offsets) == len(message.items)
        return self._new_batch_id(), batch, offsets

    def commit_put(self, batch: Batch, progress: Progress) -> int:
        """Store the batch's values from the segment; returns how many were stored.
        The caller frees the batch, whatever happens."""
        assert batch.kind == "put"
        view = self.segment.view
        pinned = frozenset(key for key, _, _ in batch.items)  # The batch's own chunks stay.
        stored = 0
        stored_bytes = 0
        # Tail first, so a prefix's head is the most recently admitted and the
        # last to be evicted (an evicted head strands every later chunk).
        for key, offset, size in reversed(batch.items):
            assert offset + size <= self.segment.size
            if self.store.put(key, batch.fingerprint, view[offset : offset + size], pinned):
                stored += 1
                stored_bytes += size
            progress(stored)
        self._count(put_bytes=stored_bytes)
        return stored

    # -- gets ----------------------------------------------------------------

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], progress: Progress
    ) -> tuple[int, list[tuple[int, int]], Batch]:
        """The leading hits, each as (offset, length) in the segment; the first miss,
        or a ring without room by the deadline, ends them."""
        segment, ring = self.segment, self.ring
        batch = Batch("get")
        spans: list[tuple[int, int]] = []
        deadline = self._deadline()

        def source(nbytes: int) -> memoryview:
            offset = ring.allocate(nbytes, deadline)
            if offset is None:
                raise _RingFull
            batch.extents.append(offset)
            return segment.view[offset : offset + nbytes]

        got_bytes = 0
        try:
            for key in keys:
                hit = self.store.get_shared(key, fingerprint, touch=False)
                if hit is not None:
                    with self._batch_lock:
                        self.pinned += 1
                    batch.shared.append(hit)  # In place: no copy at all on this side.
                    spans.append((hit.offset, hit.length))
                    got_bytes += hit.length
                else:
                    value = self.store.get(key, fingerprint, source, touch=False)
                    if value is None:
                        break
                    spans.append(self._place(value, source))
                    got_bytes += value.nbytes
                progress(len(spans))
            # Recency for the whole prefix at once, its head last: evicting the
            # head first would strand every later chunk.
            self.store.touch(list(reversed(keys[: len(spans)])))
        except _RingFull:
            self._count(ring_full=1)  # The hits so far are served; the rest are misses.
        except BaseException:
            self.free(batch)
            raise
        self._count(get_bytes=got_bytes)
        return self._new_batch_id(), spans, batch

    def _place(self, value: memoryview, source: Callable[[int], memoryview]) -> tuple[int, int]:
        """(offset, length) of ``value`` in the segment, copying it there if it is elsewhere
        (a compressed or fragmented value is reassembled outside the segment)."""
        if value.obj is self.segment.map:
            offset = _address(value) - self._segment_address
        else:
            target = source(value.nbytes)
            target[:] = value
            offset = _address(target) - self._segment_address
        assert offset >= 0 and offset + value.nbytes <= self.segment.size, (offset, value.nbytes)
        return offset, value.nbytes

    # -- both ----------------------------------------------------------------

    def free(self, batch: Batch) -> int:
        """Give a batch's extents back to the ring; returns the bytes freed."""
        freed = sum(self.ring.free(offset) for offset in batch.extents)
        batch.extents.clear()
        for hit in batch.shared:
            hit.release()
        with self._batch_lock:
            self.pinned -= len(batch.shared)
            assert self.pinned >= 0
        batch.shared.clear()
        return freed

    def _deadline(self) -> float:
        """One deadline per request, however many values it waits room for."""
        return time.monotonic() + self._ring_wait_s

    def _new_batch_id(self) -> int:
        with self._batch_lock:
            return next(self._batch_ids)


def _address(view: memoryview) -> int:
    """The memory address of a writable view's first byte (for offsets within the segment)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
