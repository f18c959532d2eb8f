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

The bytes in flight are bounded either way: the ring's size bounds those in
the ring, and ``gateway.in_place_mb_max`` those lent in place, so a client
that prepares and never commits cannot make the first tier evict more than
that much of its stored values.

A put batch also lends a page or so of the ring for its completion marks
(`protocol.write_mark`). A client that goes away with the batch open (vLLM's
default shutdown SIGKILLs its engine right after the last response) has
`commit_marked` store exactly the values it marked complete: a mark must name
the place lent for its value, and a writer's checksum in it must match the
bytes, or the value is refused (counted, a miss); an unmarked value may be
half-written and is given back unread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Reservation, SharedHit
from kvharbor.config import MIB, Config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.shm import Segment, address_of
from kvharbor.hal.checksum import checksum
from kvharbor.hal.extents import Extents
from kvharbor.telemetry.metrics import GatewayMetrics

Progress = Callable[[int], None]
"""Told how many items of a long request are done, so the client hears from it."""


class _RingFull(Exception):
    pass


_COMPLETE = frozenset((p.MarkState.COMPLETE, p.MarkState.COMPLETE_CHECKSUMMED))


def _no_progress(done: int) -> None:
    """Progress of a request nobody waits for (its client is gone)."""


class Lent(NamedTuple):
    """One value of a put batch the client was lent a place for."""

    position: int
    """Its place in the PUT_PREPARE's order (and so its completion mark's)."""
    key: bytes
    offset: int
    """Where the client writes it in the segment."""
    size: int


@dataclass(frozen=True, slots=True)
class Abandoned:
    """What `commit_marked` made of the values of a put whose client went away."""

    stored: int
    """Marked complete, checked and stored."""
    refused: int
    """Marked, but for another place or length, or with a checksum the bytes do not match."""
    unmarked: int
    """Not marked complete (maybe half-written): given back unread."""


@dataclass(slots=True)
class Batch:
    """Extents of the segment lent to one client for one transfer."""

    kind: str
    """"put" or "get"."""
    extents: list[tuple[int, int]] = field(default_factory=list)
    """Ring extents lent, as (offset, bytes asked)."""
    shared: list[SharedHit] = field(default_factory=list)
    """get: values served in place from a shared-memory RAM tier, pinned until release."""
    items: list[Lent] = field(default_factory=list)
    """put: each value lent a place, in a ring extent or in place."""
    reservations: list[Reservation] = field(default_factory=list)
    """put: values the client writes in their place in the first tier."""
    marks: int = p.SKIP
    """put: offset of the completion marks (also among ``extents``), or `SKIP`."""
    no_room: int = 0
    """put: values not stored that were lent no place, for want of room by the deadline."""
    fingerprint: bytes = b""


class Transfers:
    def __init__(
        self, config: Config, store: TieredStore, segment: Segment, ring_bytes: int, metrics: GatewayMetrics
    ) -> None:
        """``metrics``: the gateway's, counting bytes moved and values the ring had no room for."""
        assert 0 < ring_bytes <= segment.size
        self.store = store
        self.segment = segment
        self.ring = Extents(ring_bytes)  # The segment's head; RAM tiers own the rest.
        self._metrics = metrics
        self._ring_wait_s = config.gateway.ring_wait_ms / 1000
        self._in_place_bytes_max = config.gateway.in_place_mb_max * MIB
        self._value_max = config.storage.value_mb_max * MIB
        self._segment_address = address_of(segment.view)
        self._batch_ids = iter(range(1, 2**63))
        self._batch_lock = threading.Lock()
        self._checksummers = ThreadPoolExecutor(config.gateway.checksum_threads, "kvharbor-checksum")
        self.pinned = 0
        """RAM-tier values clients are reading in place right now."""
        self.reserved_bytes = 0
        """Bytes of values clients are writing in place right now (at most ``gateway.in_place_mb_max``)."""

    # -- puts ----------------------------------------------------------------

    def prepare_put(self, message: p.PutPrepare, progress: Progress) -> tuple[int, Batch, list[int]]:
        """Room for each value not yet stored; `SKIP` for the rest (stored, or no room).
        The batch's completion marks come first: without room for them nothing is lent,
        since a value lent without a mark would be lost if its client died."""
        for _, size in message.items:
            if not 0 < size <= self._value_max:
                raise p.ProtocolError(
                    p.ErrorCode.TOO_LARGE,
                    f"value of {size} bytes is outside 1..{self._value_max} (storage.value_mb_max)",
                )
        self.store.namespaces.learn(message.fingerprint, message.namespace)
        batch = Batch("put", fingerprint=message.fingerprint)
        deadline = self._deadline()
        keys = [key for key, _ in message.items]
        present = self.store.contains(keys)
        pinned = frozenset(keys)  # Room for the batch is never made by evicting its own chunks.
        offsets = []
        no_room = 0
        try:
            marked = not all(present) and self._lend_marks(batch, len(keys), deadline)
            for index, ((key, size), stored) in enumerate(zip(message.items, present, strict=True)):
                offset = self._place_put(batch, index, key, size, pinned, deadline) if marked and not stored else None
                if offset is None:
                    no_room += not stored
                    offsets.append(p.SKIP)
                    continue
                offsets.append(offset)
                progress(len(offsets))
        except BaseException:
            self.free(batch)
            raise
        batch.no_room = no_room
        if no_room:
            self._metrics.error("ring_full", no_room)
        assert len(offsets) == len(message.items)
        return self._new_batch_id(), batch, offsets

    def _lend_marks(self, batch: Batch, count: int, deadline: float) -> bool:
        """A zeroed area of ``count`` completion marks for ``batch``; False: no room by ``deadline``."""
        nbytes = count * p.MARK_BYTES
        offset = self.ring.allocate(nbytes, deadline)
        if offset is None:
            return False
        batch.extents.append((offset, nbytes))
        batch.marks = offset
        # The ring's memory held other transfers' bytes: a stale mark must not pass for one.
        self.segment.view[offset : offset + nbytes] = bytes(nbytes)
        return True

    def _place_put(
        self, batch: Batch, index: int, key: bytes, size: int, pinned: frozenset[bytes], deadline: float
    ) -> int | None:
        """Where the client writes ``key``'s value: in place in the first tier when it
        can take it there within the in-flight budget, else a ring extent (waiting
        for room until ``deadline``); None when there is neither."""
        with self._batch_lock:
            in_budget = self.reserved_bytes + size <= self._in_place_bytes_max
            self.reserved_bytes += size if in_budget else 0
        reservation = self.store.reserve(key, batch.fingerprint, size, pinned) if in_budget else None
        if reservation is not None:
            batch.reservations.append(reservation)
            batch.items.append(Lent(index, key, reservation.payload_offset, size))
            return reservation.payload_offset
        if in_budget:
            self._unreserve(size)
        offset = self.ring.allocate(size, deadline)
        if offset is not None:
            batch.extents.append((offset, size))
            batch.items.append(Lent(index, key, offset, size))
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
        known = dict(zip((lent.offset for lent in batch.items), checksums, strict=False))
        return self._store(batch, batch.items, known, progress)

    def commit_marked(self, batch: Batch) -> Abandoned:
        """Store the values of a put whose client went away before its commit: those whose
        mark says complete, names the place and length lent, and carries no checksum or
        the bytes' own. Call it only once the client is gone (no writer races the read).
        The caller frees the batch, whatever happens."""
        assert batch.kind == "put"
        if batch.marks == p.SKIP or not batch.items:
            return Abandoned(0, 0, len(batch.items))
        view = self.segment.view
        area = view[batch.marks : batch.marks + (batch.items[-1].position + 1) * p.MARK_BYTES]
        claims: list[tuple[Lent, int | None]] = []
        refused = unmarked = 0
        for lent in batch.items:
            mark = p.read_mark(area, lent.position)
            if mark.state == p.MarkState.UNMARKED:
                unmarked += 1
            elif mark.state not in _COMPLETE or (mark.place, mark.length) != (lent.offset, lent.size):
                refused += 1
            else:
                claims.append((lent, mark.checksum if mark.state == p.MarkState.COMPLETE_CHECKSUMMED else None))
        digests = self._checksummers.map(
            lambda claim: checksum(view[claim[0].offset : claim[0].offset + claim[0].size]), claims
        )
        complete: list[Lent] = []
        known: dict[int, int] = {}
        for (lent, claimed), digest in zip(claims, digests, strict=True):
            if claimed is not None and claimed != digest:
                refused += 1  # Damaged after its writer's copy, or a writer's bug: never stored.
                continue
            complete.append(lent)
            known[lent.offset] = digest
        return Abandoned(self._store(batch, complete, known, _no_progress), refused, unmarked)

    def _store(self, batch: Batch, items: Sequence[Lent], known: dict[int, int], progress: Progress) -> int:
        """Store ``items`` (some or all of the batch's) with the checksums ``known`` by offset;
        the reservations of the others are left in the batch for `free`."""
        view = self.segment.view
        pinned = frozenset(lent.key for lent in batch.items)  # The batch's own chunks stay.
        in_place = {reservation.payload_offset: reservation for reservation in batch.reservations}
        batch.reservations.clear()
        stored = 0
        stored_bytes = 0
        try:
            # Values written in place without the writer's checksum (a GPU's DMA) are
            # checksummed first, several at a time: xxh3 lets go of the GIL.
            unknown = [lent.offset for lent in items if lent.offset in in_place and lent.offset not in known]
            digests = self._checksummers.map(lambda offset: checksum(in_place[offset].payload), unknown)
            known.update(zip(unknown, digests, strict=True))
            # Tail first, so a prefix's head is the most recently admitted and the
            # last to be evicted (an evicted head strands every later chunk).
            for _, key, offset, size in reversed(items):
                assert offset + size <= self.segment.size
                reservation = in_place.pop(offset, None)
                if reservation is not None:
                    self._unreserve(size)
                    # Used up, stored or not.
                    done = self.store.complete(reservation, pinned, known.get(offset))
                else:
                    done = self.store.put(
                        key, batch.fingerprint, view[offset : offset + size], pinned, known.get(offset)
                    )
                if done:
                    stored += 1
                    stored_bytes += size
                progress(stored)
        finally:
            batch.reservations.extend(in_place.values())  # Left for `free` to give back.
        self._metrics.bytes_in.inc(stored_bytes)
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
            # A prefix in the first tier, in one pass: per value only its pin and header check.
            run = self.store.get_shared_run(keys, fingerprint)
            with self._batch_lock:
                self.pinned += len(run)
            batch.shared.extend(run)
            for served in run:
                spans.append((served.offset, served.length))
                got_bytes += served.length
            if run:
                progress(len(spans))
            for key in keys[len(run) :]:
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
            self._metrics.error("ring_full")  # The hits so far are served; the rest are misses.
        except BaseException:
            self.free(batch)
            raise
        self._metrics.bytes_out.inc(got_bytes)
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
