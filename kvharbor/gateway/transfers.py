"""Transfers: values moved between the shared-memory segment and the store, in batches.

A put batch lends the client one place per value it must copy in (values
already stored, or with no room by the request's deadline, get `SKIP`). When
the first tier lives in the segment, that place is the value's final one (a
`Reservation`): the client writes it there and the commit only checksums it,
so a value crosses memory once on its way in. Otherwise it is an extent of
the ring, which the commit stores from and frees. A get batch names the
leading hits in place or reads them into ring extents the client copies out
of; its release gives the room back. A batch belongs to one connection: the
gateway frees what a connection still holds when it closes.

The ring's size bounds the bytes in flight either way: reservations count
against it, so a client that prepares and never commits cannot make the
first tier evict more than a ring's worth of stored values.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvharbor.cache.format import checksum
from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Reservation, SharedHit
from kvharbor.config import MIB, Config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.shm import Segment, address_of
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
    extents: list[tuple[int, int]] = field(default_factory=list)
    """Ring extents lent, as (offset, bytes asked)."""
    shared: list[SharedHit] = field(default_factory=list)
    """get: values served in place from a shared-memory RAM tier, pinned until release."""
    items: list[tuple[bytes, int, int]] = field(default_factory=list)
    """put: (key, offset, length) of each value to store from a ring extent."""
    reservations: list[Reservation] = field(default_factory=list)
    """put: values the client writes in their place in the first tier."""
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
        self._segment_address = address_of(segment.view)
        self._batch_ids = iter(range(1, 2**63))
        self._batch_lock = threading.Lock()
        self._checksummers = ThreadPoolExecutor(config.gateway.checksum_threads, "kvharbor-checksum")
        self.pinned = 0
        """RAM-tier values clients are reading in place right now."""
        self.reserved_bytes = 0
        """Bytes of values clients are writing in place right now (at most the ring's size)."""

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
        keys = [key for key, _ in message.items]
        present = self.store.contains(keys)
        pinned = frozenset(keys)  # Room for the batch is never made by evicting its own chunks.
        offsets = []
        no_room = 0
        try:
            for (key, size), stored in zip(message.items, present, strict=True):
                offset = None if stored else self._place_put(batch, key, size, pinned, deadline)
                if offset is None:
                    no_room += not stored
                    offsets.append(p.SKIP)
                    continue
                offsets.append(offset)
                progress(len(offsets))
        except BaseException:
            self.free(batch)
            raise
        if no_room:
            self._count(ring_full=no_room)
        assert len(offsets) == len(message.items)
        return self._new_batch_id(), batch, offsets

    def _place_put(self, batch: Batch, key: bytes, size: int, pinned: frozenset[bytes], deadline: float) -> int | None:
        """Where the client writes ``key``'s value: in place in the first tier when it
        can take it there within the in-flight budget, else a ring extent (waiting
        for room until ``deadline``); None when there is neither."""
        with self._batch_lock:
            in_budget = self.reserved_bytes + size <= self.ring.size
            self.reserved_bytes += size if in_budget else 0
        reservation = self.store.reserve(key, batch.fingerprint, size, pinned) if in_budget else None
        if reservation is not None:
            batch.reservations.append(reservation)
            batch.items.append((key, reservation.payload_offset, size))
            return reservation.payload_offset
        if in_budget:
            self._unreserve(size)
        offset = self.ring.allocate(size, deadline)
        if offset is not None:
            batch.extents.append((offset, size))
            batch.items.append((key, offset, size))
        return offset

    def commit_put(self, batch: Batch, checksums: Sequence[int], progress: Progress) -> int:
        """Store the batch's values from the segment; returns how many were stored.
        ``checksums``: the writer's, one per value lent, or none (see `p.PutCommit`).
        The caller frees the batch, whatever happens."""
        assert batch.kind == "put"
        if checksums and len(checksums) != len(batch.items):
            raise p.ProtocolError(
                p.ErrorCode.MALFORMED, f"PUT_COMMIT has {len(checksums)} checksums for {len(batch.items)} values"
            )
        known = dict(zip((offset for _, offset, _ in batch.items), checksums, strict=False))
        view = self.segment.view
        pinned = frozenset(key for key, _, _ in batch.items)  # The batch's own chunks stay.
        in_place = {reservation.payload_offset: reservation for reservation in batch.reservations}
        batch.reservations.clear()
        stored = 0
        stored_bytes = 0
        try:
            # Values written in place without the writer's checksum (a GPU's DMA) are
            # checksummed first, several at a time: xxh3 lets go of the GIL.
            unknown = [offset for offset in in_place if offset not in known]
            digests = self._checksummers.map(lambda offset: checksum(in_place[offset].payload), unknown)
            known.update(zip(unknown, digests, strict=True))
            # Tail first, so a prefix's head is the most recently admitted and the
            # last to be evicted (an evicted head strands every later chunk).
            for key, offset, size in reversed(batch.items):
                assert offset + size <= self.segment.size
                reservation = in_place.pop(offset, None)
                if reservation is not None:
                    self._unreserve(size)
                    # Used up, stored or not.
                    done = self.store.complete(reservation, pinned, known.get(offset))
                else:
                    done = self.store.put(key, batch.fingerprint, view[offset : offset + size], pinned)
                if done:
                    stored += 1
                    stored_bytes += size
                progress(stored)
        finally:
            batch.reservations.extend(in_place.values())  # Left for `free` to give back.
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
            batch.extents.append((offset, nbytes))
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
            offset = address_of(value) - self._segment_address
        else:
            target = source(value.nbytes)
            target[:] = value
            offset = address_of(target) - self._segment_address
        assert offset >= 0 and offset + value.nbytes <= self.segment.size, (offset, value.nbytes)
        return offset, value.nbytes

    # -- both ----------------------------------------------------------------

    def free(self, batch: Batch) -> int:
        """Give a batch's extents back to the ring; returns the bytes freed."""
        freed = sum(self.ring.free(offset, nbytes) for offset, nbytes in batch.extents)
        batch.extents.clear()
        for reservation in batch.reservations:
            self.store.abandon(reservation)
            self._unreserve(reservation.payload.nbytes)
            freed += reservation.payload.nbytes
        batch.reservations.clear()
        for hit in batch.shared:
            hit.release()
        with self._batch_lock:
            self.pinned -= len(batch.shared)
            assert self.pinned >= 0
        batch.shared.clear()
        return freed

    def close(self) -> None:
        self._checksummers.shutdown(wait=True)

    def _unreserve(self, nbytes: int) -> None:
        with self._batch_lock:
            self.reserved_bytes -= nbytes
            assert self.reserved_bytes >= 0, self.reserved_bytes

    def _deadline(self) -> float:
        """One deadline per request, however many values it waits room for."""
        return time.monotonic() + self._ring_wait_s

    def _new_batch_id(self) -> int:
        with self._batch_lock:
            return next(self._batch_ids)
