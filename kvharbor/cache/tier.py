"""One tier: a device, the index of what it holds, its budget, codec and breaker.

The tier is where the invariants of the object format meet a device: every
write is encoded with a header and checksums, every read is verified, and a
read that fails verification is counted, dropped and reported as a miss. An
object of another format version is another release's on a shared tier: a miss,
said once, left in place, and never replaced by a write of this release (see
`kvharbor.cache.format`, mixed releases).
Device faults are caught here too and fed to the tier's circuit breaker, so
that nothing above the tier ever sees an exception from storage.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import NamedTuple

from kvharbor.cache.breaker import Attempt, BreakerState, CircuitBreaker
from kvharbor.cache.format import (
    HEADER_BYTES,
    Codec,
    CorruptObject,
    EncodedPart,
    ForeignFormat,
    ForeignLayout,
    PayloadChecksum,
    ReadBack,
    check_header,
    decode,
    encode,
    parse_header,
    verify_part,
)
from kvharbor.cache.index import Entry, OverBudget, TierIndex
from kvharbor.cache.keys import FORMAT_VERSION, ChunkKey, fragment_key, tier_fingerprint
from kvharbor.cache.namespaces import NamespaceTags
from kvharbor.cache.probe import ProbeFailed, probe_device
from kvharbor.cache.writequeue import WriteQueueStatus
from kvharbor.hal.base import (
    Buffer,
    BufferTooSmall,
    CardDevice,
    Device,
    DeviceCorrupt,
    DeviceError,
    DeviceFull,
    Health,
    HealthState,
    InPlaceWrites,
    PersistentDevice,
    SharedSpan,
    SharedSpans,
    TargetUnreachable,
)
from kvharbor.telemetry.log import OnceLog, get_logger
from kvharbor.telemetry.metrics import CodecOp, Outcome, TierCounts, TierMetrics, TierOp

_log = get_logger("kvharbor.cache.tier")

LRU_SCAN_ENTRIES = (16, 4096)
"""Entries looked at, least recent first, to free room for one value written in place: a
few usually do (values are of a size); more only when the oldest are pinned."""

_DEVICE_VERBS = {
    TierOp.PUT: "write", TierOp.GET: "read", TierOp.DELETE: "delete", TierOp.LOOKUP: "exists",
    TierOp.PROBE: "probe", TierOp.INDEX: "index",
}  # fmt: skip
"""What each operation asks of the device, as its fault's log line says it."""

BufferSource = Callable[[int], memoryview]
"""Hands out a writable buffer of exactly the asked size for a read to land in."""


MAPPED_BUFFER_MIN_BYTES = 256 * 1024
"""From this size on `new_buffer` maps fresh pages; below it a ``bytearray`` does (the copy
is short, and thousands of small live mappings would approach ``vm.max_map_count``)."""


def new_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of fresh memory; page-aligned (an anonymous mapping, freed with its last view)
    from `MAPPED_BUFFER_MIN_BYTES` on.

    Page-aligned, not a ``bytearray`` (16 bytes past a page edge): the kernel copies a file's
    bytes into a destination off a page edge at a quarter of the speed on these machines
    (2.5 GB/s against 10 GB/s from the page cache, bench/store.py), and the payload of an
    object read whole then lands page-aligned too, as in the gateway's shared segment."""
    if nbytes < MAPPED_BUFFER_MIN_BYTES:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


@dataclass(frozen=True, slots=True)
class Damaged:
    """A read's answer for an object that failed verification (counted and dropped)."""


@dataclass(frozen=True, slots=True)
class SharedHit:
    """A value served in place: ``offset`` and ``length`` of the value (not its header)
    in the shared segment, valid until `release`."""

    device: SharedSpans
    span: SharedSpan
    offset: int
    length: int

    def release(self) -> None:
        self.device.unpin(self.span)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Room for one value in its final place on an `InPlaceWrites` tier: the writer
    fills ``payload``; `Tier.complete` then stores it, or `Tier.abandon` gives it back."""

    tier: Tier
    key: bytes
    fingerprint: bytes
    span: SharedSpan
    payload: memoryview
    """The value's bytes: the span less the header room before them."""
    attempt: Attempt
    """The breaker's attempt this put runs under, ended by `Tier.complete` or `Tier.abandon`."""

    @property
    def payload_offset(self) -> int:
        """Where ``payload`` starts in the shared segment."""
        return self.span.offset + HEADER_BYTES


class TierUsage(NamedTuple):
    """What a tier holds, from its index alone; -1 each where the index cannot answer."""

    used_bytes: int
    """Bytes of the objects stored (headers included)."""
    allocated_bytes: int
    """What they take on the device (each object's whole pages or slab slot,
    `kvharbor.hal.base.Device.allocation_bytes`): what the budget counts, at least ``used_bytes``."""
    keys: int


@dataclass(frozen=True, slots=True)
class TierStatus:
    name: str
    device_type: str
    codec: str
    capacity_bytes: int
    """The tier's budget, which ``allocated_bytes`` is counted against."""
    used_bytes: int
    """Bytes of the objects stored (headers included); -1: the index did not answer."""
    keys: int
    health: str
    health_detail: str
    breaker: str
    counters: TierCounts = field(default_factory=TierCounts)
    device_statuses: dict[str, int] = field(default_factory=dict)
    """A card's answers other than success, by status code (misses included)."""
    layouts: dict[str, int] = field(default_factory=dict)
    """Objects stored per layout: the engine fingerprint's digest, hex, -> how many; under
    the stored digest where this tier cannot tell the engine's (see `Tier.engine_fingerprint`)."""
    write_queue: WriteQueueStatus | None = None
    """The tier's write queue, when it is written asynchronously (filled by the store)."""
    fallback: bool = False
    """The local fallback tier, opened because no configured persistent tier did (``storage.fallback_path``)."""
    allocated_bytes: int = field(kw_only=True)
    """What the objects take on the device (`TierUsage.allocated_bytes`): what evictions keep
    within ``capacity_bytes``; ``allocated_bytes - used_bytes`` is the device's rounding."""


class Tier:
    def __init__(
        self,
        name: str,
        device: Device,
        index: TierIndex,
        capacity_bytes: int,
        breaker: CircuitBreaker,
        codec: Codec = Codec.NONE,
        device_type: str = "",
        reopen_index: Callable[[], TierIndex] | None = None,
        layout: bytes = b"",
        device_evicts: bool = False,
        metrics: TierMetrics | None = None,
        fallback: bool = False,
    ) -> None:
        """``layout``: this tier's own settings that change the bytes it stores (a card's
        fragment size, `kvharbor.cache.keys.card_layout`); they enter the fingerprint of
        every object it stores, so that a change of them makes this tier's objects misses
        and no other tier's. ``device_evicts``: the device drops keys on its own (a card
        with key eviction on), so it, not the index, says what is here. ``metrics``: where
        this tier counts (the gateway's registry); a registry of its own without one.
        ``fallback``: the store's local fallback tier (shown as such in `status`)."""
        assert capacity_bytes > 0, capacity_bytes
        self.name = name
        self.device = device
        self.index = index
        self.capacity_bytes = capacity_bytes
        self.breaker = breaker
        self.codec = codec
        self.device_type = device_type or type(device).__name__
        self._reopen_index = reopen_index
        self.metrics = metrics if metrics is not None else TierMetrics.standalone(name)
        if codec is not Codec.NONE:
            self.metrics.watch_compression()
        self._once = OnceLog(_log)
        self.layout = layout
        self.device_evicts = device_evicts
        self.fallback = fallback
        self._stored_fingerprints: dict[bytes, bytes] = {}
        """Engine fingerprint -> the one this tier stores under (a few layouts per process)."""
        self._engine_fingerprints: dict[bytes, bytes] = {}
        self._watched_health = HealthState.OK
        """The health `watch_health` last said (a tier starts ok: it passed its probe)."""
        self.namespaces = NamespaceTags()
        """Whose namespace each layout's objects are, for their headers; a store shares
        one among its tiers (`kvharbor.cache.namespaces`)."""

    @property
    def counters(self) -> TierCounts:
        """This tier's counts now, read from its metrics (one source of numbers)."""
        return self.metrics.snapshot()

    # -- reads -------------------------------------------------------------

    @property
    def resident(self) -> bool:
        """Are this tier's values verified where readers see them, beyond anyone's reach but
        the gateway's, and stored plain (the index knows their sizes)? A shared-memory
        tier's are (see `_verify_shared`): its hits can be promised as they are. A tier
        that outlives the gateway (files) may have been damaged at rest, and a RAM tier in
        the gateway's memory was checksummed before the copy: their hits are read back
        before a promise."""
        return isinstance(self.device, SharedSpans) and self.codec is Codec.NONE

    def value_sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key, the bytes of its value if held as one plain object, or None when it is
        absent; from the index alone. (A fragmented value reads as a size larger than its
        own: one header per fragment.)"""
        try:
            sizes = self.index.nbytes(keys)
        except DeviceError as err:
            self._index_fault(err)
            return [None] * len(keys)
        return [None if n is None else n - HEADER_BYTES for n in sizes]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the index says are here; an open breaker says none."""
        if self.breaker.state is BreakerState.OPEN:
            return [False] * len(keys)
        try:
            present = self.index.contains(keys)
        except DeviceError as err:
            self._index_fault(err)
            return [False] * len(keys)
        return self._on_device(keys, present) if self.device_evicts else present

    def _on_device(self, keys: Sequence[bytes], present: list[bool]) -> list[bool]:
        """``present`` less the keys the device evicted on its own, which leave the index."""
        asked = [key for key, here in zip(keys, present, strict=True) if here]
        if not asked:
            return present
        with self._attempt(TierOp.LOOKUP) as attempt:
            if not attempt.allowed:
                return [False] * len(keys)
            try:
                kept = self.device.exists(asked)
            except DeviceError as err:
                self._fault(TierOp.LOOKUP, err)
                return [False] * len(keys)
            self._ok()
            self.metrics.outcome(TierOp.LOOKUP, Outcome.OK)
        gone = {key for key, here in zip(asked, kept, strict=True) if not here}
        if gone:
            self._remove_from_index(list(gone))
        return [here and key not in gone for key, here in zip(keys, present, strict=True)]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` used, the last most recently (see `read`'s ``touch``)."""
        try:
            self.index.touch(keys)
        except DeviceError as err:
            self._index_fault(err)

    def read(
        self, key: bytes, fingerprint: bytes, source: BufferSource = new_buffer, touch: bool = True
    ) -> memoryview | None:
        """The verified value under ``key``, or None (miss, corrupt, fault, breaker open).

        The object's first part is read into ``source(size)``; an uncompressed
        single-part value is returned as a view into that buffer, starting
        `HEADER_BYTES` in: no copy beyond the device's own. The gateway passes
        a source that hands out shared memory, so a hit lands where the client
        reads it. ``touch=False`` leaves recency to the caller, who can mark a
        whole prefix at once, its head last (see `TieredStore.get_many`).
        """
        with self._attempt(TierOp.GET) as attempt:
            if not attempt.allowed:
                return None
            with self.metrics.duration[TierOp.GET].time():
                return self._read_verified(key, self._stored_fingerprint(fingerprint), source, touch)

    def _read_verified(self, key: bytes, fingerprint: bytes, source: BufferSource, touch: bool) -> memoryview | None:
        """`read`'s body, run under the breaker's attempt."""
        try:
            value = decode(key, fingerprint, self._read_part_fn(key, source), observe=self._decoded)
        except CorruptObject as err:  # `ForeignFormat` included: `_corrupt` tells it apart.
            self.metrics.outcome(TierOp.GET, self._corrupt(key, err))
            return None
        except BufferTooSmall:
            # Rewritten larger between size and read by another process: a miss, and no
            # judgement of the device.
            self.metrics.outcome(TierOp.GET, Outcome.MISS)
            return None
        except DeviceError as err:
            self._fault(TierOp.GET, err)
            return None
        self._ok()
        if value is None:
            # The index said present, the device says gone (evicted by another
            # process, deleted by hand): forget it so lookups stop promising it.
            self._remove_from_index([key])
            self.metrics.outcome(TierOp.GET, Outcome.MISS)
            return None
        if touch:
            self.touch([key])
        self.metrics.hit(value.nbytes)
        return value

    def read_shared(self, key: bytes, fingerprint: bytes, touch: bool = True) -> SharedHit | None:
        """``key``'s value in place in shared memory, pinned until `SharedHit.release`.

        None when this tier cannot serve it in place (a miss, not a shared-memory
        device, compressed or fragmented); the caller then reads it with `read`.
        Only the header is checked here: the payload was verified when it landed
        in memory that no client can write (see `_verify_shared`).
        """
        device = self.device
        if not isinstance(device, SharedSpans):
            return None
        with self._attempt(TierOp.GET) as attempt:
            if not attempt.allowed:
                return None
            hit = self._pin_verified(device, key, self._stored_fingerprint(fingerprint))
            if hit is not None:
                self._ok()
                if touch:
                    self.touch([key])
                self.metrics.hit(hit.length)
            return hit

    def read_shared_run(self, keys: Sequence[bytes], fingerprint: bytes) -> list[SharedHit]:
        """The leading ``keys`` served in place as `read_shared` serves one (each pinned until
        its `SharedHit.release`, its header checked; recency left to the caller), up to the
        first this tier cannot serve so.

        A GET names a whole prefix: the run takes one breaker attempt and one count of its
        hits, so a value's own cost is its pin and its header's check. The breaker then
        hears one success per run of in-place hits rather than per value.
        """
        device = self.device
        hits: list[SharedHit] = []
        if not keys or not isinstance(device, SharedSpans):
            return hits
        with self._attempt(TierOp.GET) as attempt:
            if not attempt.allowed:
                return hits
            stored = self._stored_fingerprint(fingerprint)
            try:
                for key in keys:
                    hit = self._pin_verified(device, key, stored)
                    if hit is None:
                        break
                    hits.append(hit)
            except BaseException:
                for hit in hits:  # Nobody will release them: never leave a value pinned.
                    hit.release()
                raise
            if hits:
                self._ok()
                self.metrics.hit(sum(hit.length for hit in hits), len(hits))
        return hits

    def _pin_verified(self, device: SharedSpans, key: bytes, fingerprint: bytes) -> SharedHit | None:
        """``key``'s value pinned with its header checked, run under the breaker's attempt; a
        miss, damage or a value `read` must serve is counted here, a hit by the caller."""
        span = device.pin(key)
        if span is None:
            self._remove_from_index([key])
            self._ok()
            self.metrics.outcome(TierOp.GET, Outcome.MISS)
            return None
        try:
            header = check_header(device.view(span), key, fingerprint, 0)
        except CorruptObject as err:
            device.unpin(span)
            self.metrics.outcome(TierOp.GET, self._corrupt(key, err))
            return None
        if header.fragment_count != 1 or header.codec is not Codec.NONE:
            device.unpin(span)
            return None  # Served by `read` instead; this was no judgement of the device.
        return SharedHit(device, span, span.offset + HEADER_BYTES, header.raw_length)

    def read_evicted(self, entry: Entry) -> tuple[bytes, memoryview] | None:
        """Read an entry the index has already let go, for write-back demotion.

        Its own header names its layout; it is verified like any read, but
        counted as neither a get nor a hit.
        """
        try:
            return self._read_described(entry.key)
        except (CorruptObject, DeviceError):
            return None

    def read_described(self, key: bytes) -> tuple[bytes, memoryview] | Damaged | None:
        """``key``'s engine fingerprint and verified value, told by the object's own header,
        for a copy no engine asked for (the RAM refill): counted as neither a get nor a hit,
        and recency is left as it was. A damaged object is counted, dropped and answered
        `Damaged`; None: gone, unreadable (a fault, fed to the breaker) or stored under a
        fingerprint this process cannot tell (see `_read_described`)."""
        with self._attempt(TierOp.GET) as attempt:
            if not attempt.allowed:
                return None
            try:
                described = self._read_described(key)
            except ForeignFormat as err:
                self._foreign(err)
                return None
            except CorruptObject as err:
                self._corrupt(key, err)
                return Damaged()
            except DeviceError as err:
                self._fault(TierOp.GET, err)
                return None
            self._ok()
            return described

    def _read_described(self, key: bytes) -> tuple[bytes, memoryview] | None:
        """The engine fingerprint the header of ``key``'s object names, and its verified value;
        raises `CorruptObject` or `DeviceError`."""
        head = memoryview(bytearray(HEADER_BYTES))
        got = self.device.peek(key, head)
        if got is None:
            return None
        header = parse_header(head[:got])
        stored = header.fingerprint
        # The tiers above store under the engine's fingerprint; one this process never
        # saw (stored before a restart) cannot be told from this tier's own: not copied.
        fingerprint = self.engine_fingerprint(stored)
        if fingerprint is None:
            return None
        self.namespaces.learn(fingerprint, header.namespace)  # So that the copy records it too.
        value = decode(key, stored, self._read_part_fn(key, new_buffer), observe=self._decoded)
        return None if value is None else (fingerprint, value)

    # -- writes ------------------------------------------------------------

    def write(
        self,
        key: bytes,
        fingerprint: bytes,
        value: Buffer,
        pinned: frozenset[bytes] = frozenset(),
        on_evict: Callable[[Sequence[Entry]], None] | None = None,
        behind: bool = False,
        value_checksum: int | None = None,
    ) -> bool:
        """Store ``value``; True if stored.

        ``value_checksum`` is `kvharbor.hal.checksum.checksum` of ``value`` when the caller
        has it (its writer took it while the bytes were in its cache): a full pass over the
        value saved. A wrong one costs only this value: its reads fail their check, a miss.

        Entries evicted to make room are first handed to ``on_evict`` while
        their bytes are still on the device (write-back demotes them from
        there), then deleted *before* the new value is written: a device whose
        hard limit is the tier budget (RAM) must really have the room the index
        promised, or every put into a full tier would fail.

        ``behind``: store it as the least recently used value, only into free
        room and only if the key is not here yet (see `TierIndex.admit`); False,
        quietly, when it does not fit: the refill's end, not a fault.

        A key whose object here is of another format version is not written (False, said
        once): it is another release's, and a release replacing the other's objects under
        the same key would have the two fight over it, each write undone by the next of the
        other. It stays until its release replaces it or the budget evicts it. (Keys carry
        the format version, so releases meet on a key only through a deliberate copy.)
        """
        with self._attempt(TierOp.PUT) as attempt:
            if not attempt.allowed:
                return False
            with self.metrics.duration[TierOp.PUT].time():
                stored = self._stored_fingerprint(fingerprint)
                namespace = self.namespaces.tag(fingerprint)
                return self._write_encoded(key, stored, namespace, value, pinned, on_evict, behind, value_checksum)

    def _write_encoded(
        self,
        key: bytes,
        fingerprint: bytes,
        namespace: int,
        value: Buffer,
        pinned: frozenset[bytes],
        on_evict: Callable[[Sequence[Entry]], None] | None,
        behind: bool,
        value_checksum: int | None,
    ) -> bool:
        """`write`'s body, run under the breaker's attempt."""
        if behind and self.contains([key])[0]:
            return False
        if self._held_by_another_release(key):
            return False
        try:
            parts = encode(
                key, fingerprint, value, self.codec, self.device.max_value_bytes, value_checksum, namespace,
                observe=self._encoded,
            )  # fmt: skip
        except ValueError as err:
            return self._unstorable(err)
        entry = self._entry_of(key, fingerprint, parts)
        if not self._admit(entry, pinned, on_evict, behind):
            return False
        try:
            for part in parts:
                part.put_on(self.device)
        except DeviceFull as err:
            self.metrics.outcome(TierOp.PUT, Outcome.FULL)
            self._once.say(
                f"full:{self.name}",
                f"tier '{self.name}' is full ({err}); new chunks are not stored there",
            )
            self._forget(entry)
            self._ok()  # Full is not sick: reads still work.
            return False
        except DeviceError as err:
            self._forget(entry)
            self._fault(TierOp.PUT, err)
            return False
        if not self._verify_shared(key, fingerprint, len(parts)):
            self._forget(entry)
            return False
        return self._stored(entry)

    def reserve(self, key: bytes, fingerprint: bytes, nbytes: int, pinned: frozenset[bytes]) -> Reservation | None:
        """Room to write a value of ``nbytes`` where this tier will keep it, or None:
        the device cannot take writes in place (or not of this size: a small value that
        shares its pages, `InPlaceWrites.writes_in_place`; nothing is evicted for it), the
        value would be encoded (compressed, fragmented), the breaker is open, or no room
        came free by evicting least recently used values (never ``pinned`` ones).
        """
        device, total = self.device, HEADER_BYTES + nbytes
        if not isinstance(device, InPlaceWrites) or self.codec is not Codec.NONE or not device.writes_in_place(total):
            return None
        room = device.allocation_bytes(total)
        if total > device.max_value_bytes or room > self.capacity_bytes:
            return None
        with ExitStack() as ending:
            attempt = ending.enter_context(self._attempt(TierOp.PUT))
            if not attempt.allowed:
                return None
            span = device.reserve(total)
            if span is None:
                # The device holds about the tier budget: room for a value in flight
                # comes from the values least recently used, as it would at admission.
                try:
                    self.drop(self._least_recent(room, pinned))
                except DeviceError as err:
                    self._index_fault(err)
                    return None
                span = device.reserve(total)
                if span is None:
                    return None
            assert span.length == total, (span.length, total)
            ending.pop_all()  # The attempt lives on in the reservation, until complete or abandon.
            return Reservation(self, bytes(key), bytes(fingerprint), span, device.view(span)[HEADER_BYTES:], attempt)

    def complete(
        self,
        reservation: Reservation,
        pinned: frozenset[bytes] = frozenset(),
        on_evict: Callable[[Sequence[Entry]], None] | None = None,
        value_checksum: int | None = None,
    ) -> bool:
        """Store a filled reservation under its key; True if stored. Whatever the
        outcome, the reservation is used up (adopted or given back).

        ``value_checksum`` is the writer's checksum of what it wrote, taken while
        it copied; without one it is taken here, over the bytes where they stay.
        Either way the writer has given up its write access to them by now (see
        `SharedRamDevice`), and a full read verifies the bytes against it.
        """
        device = self.device
        assert reservation.tier is self and isinstance(device, InPlaceWrites)
        key, fingerprint, span = reservation.key, reservation.fingerprint, reservation.span
        with reservation.attempt, self.metrics.duration[TierOp.PUT].time():
            stored = self._stored_fingerprint(fingerprint)
            (part,) = encode(
                key,
                stored,
                reservation.payload,
                Codec.NONE,
                device.max_value_bytes,
                value_checksum,
                self.namespaces.tag(fingerprint),
            )
            entry = self._entry_of(key, stored, [part])
            assert entry.nbytes == span.length, (entry.nbytes, span.length)
            if not self._admit(entry, pinned | {key}, on_evict):
                device.abandon(span)
                return False
            device.view(span)[:HEADER_BYTES] = part.header
            device.adopt(key, span)
            return self._stored(entry)

    def abandon(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be completed."""
        device = self.device
        assert reservation.tier is self and isinstance(device, InPlaceWrites)
        with reservation.attempt:  # A half-open breaker's trial that never reached an outcome.
            device.abandon(reservation.span)

    def drop(self, victims: Sequence[Entry]) -> None:
        """Delete the bytes of entries the index already let go."""
        for victim in victims:
            self._delete_parts(victim.key, victim.parts)
            self.metrics.evicted(victim.nbytes)

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            try:
                entry = self.index.get(key)
            except DeviceError as err:
                self._index_fault(err)
                entry = None
            self._remove_from_index([key])
            self._delete_parts(key, entry.parts if entry else 1)

    def clear(self) -> int:
        """Delete everything on the device; returns how many objects went."""
        removed = 0
        for device_key, _ in list(self.device.scan()):
            removed += self._delete_quietly(device_key)
        self.index.rebuild([])
        return removed

    # -- probing -----------------------------------------------------------

    def probe(self) -> BreakerState:
        """One trial without a request: when the breaker lets a trial through (half-open,
        none running), run the device probe (`kvharbor.cache.probe`: write, read back and
        delete a small object, so the medium itself answers) and report the outcome as
        any operation would: an answer closes the breaker (said once: answers again; a
        full card answered too), a failure opens it for the next, longer wait. Otherwise
        nothing. Returns the breaker's state after it. This is how a tier comes back with
        no traffic."""
        if self.breaker.state is not BreakerState.HALF_OPEN:
            return self.breaker.state
        with self.breaker.attempt() as attempt:
            if not attempt.trial:
                return self.breaker.state  # A request holds the trial; it reports.
            try:
                probe_device(self.device, self.codec)
            except ProbeFailed as failed:
                if isinstance(failed.error, DeviceFull):
                    self._ok()  # Full, but it answered: the tier serves its reads again.
                    self.metrics.outcome(TierOp.PROBE, Outcome.OK)
                else:
                    self._fault(TierOp.PROBE, failed.error or DeviceError(self.name, str(failed)))
            else:
                self._ok()
                self.metrics.outcome(TierOp.PROBE, Outcome.OK)
        return self.breaker.state

    # -- state -------------------------------------------------------------

    def engine_fingerprint(self, stored: bytes) -> bytes | None:
        """The engine fingerprint behind the fingerprint an object of this tier is stored
        under; None when this tier has a ``layout`` of its own and no engine of this
        process used that fingerprint (it cannot be told from the digest)."""
        return self._engine_fingerprints.get(bytes(stored)) if self.layout else bytes(stored)

    def learn_engine_fingerprints(self, fingerprints: Sequence[bytes]) -> None:
        """Let `engine_fingerprint` tell these engine fingerprints behind this tier's own
        (the gateway passes every registered layout, also those known from before a
        restart, so a card tier's counts and a purge by layout name them before any engine
        of this process used them); nothing to learn on a tier without a ``layout``."""
        for fingerprint in fingerprints:
            self._stored_fingerprint(fingerprint)

    def usage(self) -> TierUsage:
        """What the tier holds, from the index alone (no device command); -1 each when the
        index cannot answer (a fault, counted)."""
        index = self.index
        try:
            return TierUsage(index.used_bytes(), index.allocated_bytes(), index.count())
        except DeviceError as err:
            self._index_fault(err)
            return TierUsage(-1, -1, -1)

    def layout_counts(self) -> dict[str, int]:
        """`TierStatus.layouts`, from the index alone; empty when the index cannot answer
        (a fault, counted)."""
        try:
            stored = self.index.layout_counts()
        except DeviceError as err:
            self._index_fault(err)
            return {}
        counts: dict[str, int] = {}
        for fingerprint, objects in stored.items():
            digest = (self.engine_fingerprint(fingerprint) or fingerprint).hex()
            counts[digest] = counts.get(digest, 0) + objects
        return counts

    def watch_health(self) -> Health:
        """Read the device's health and say each change of its state once: degraded as a
        WARNING (it serves, but needs attention: a card running hot, a failed supercapacitor,
        a filesystem nearly full), failed as an ERROR, ok again at INFO. The gateway's prober
        calls it every ``card.health_interval_s``; a state that lasts is not said again."""
        health = self.device.health()
        before, self._watched_health = self._watched_health, health.state
        if health.state is not before:
            if health.state is HealthState.OK:
                _log.info("kvharbor: tier '%s' health ok again (was %s)", self.name, before.value)
            else:
                level = logging.ERROR if health.state is HealthState.FAILED else logging.WARNING
                _log.log(level, "kvharbor: tier '%s' health %s: %s", self.name, health.state.value, health.detail)
        return health

    def status(self) -> TierStatus:
        health = self.device.health()
        usage = self.usage()
        return TierStatus(
            name=self.name,
            device_type=self.device_type,
            codec=self.codec.name.lower(),
            capacity_bytes=self.capacity_bytes,
            used_bytes=usage.used_bytes,
            allocated_bytes=usage.allocated_bytes,
            keys=usage.keys,
            health=health.state.value,
            health_detail=health.detail,
            breaker=self.breaker.state.value,
            counters=self.counters,
            device_statuses=self.device.status_counts() if isinstance(self.device, CardDevice) else {},
            layouts=self.layout_counts(),
            fallback=self.fallback,
        )

    def close(self) -> None:
        self.index.close()
        self.device.close()

    # -- internals ---------------------------------------------------------

    def _encoded(self, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        self.metrics.codec(CodecOp.ENCODE, raw_bytes, stored_bytes, seconds)

    def _decoded(self, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        self.metrics.codec(CodecOp.DECODE, raw_bytes, stored_bytes, seconds)

    def _read_part_fn(self, key: bytes, source: BufferSource) -> Callable[[ChunkKey], ReadBack | None]:
        """A reader of one device object; fragment 0 lands in a buffer from ``source``.

        The payload is checksummed slice by slice (or piece by piece, on the device's
        I/O threads) as the device fills the buffer, each while it is still in the CPU
        cache; `decode` verifies
        the object with that checksum before anything uses the value.
        """

        def read_part(device_key: ChunkKey) -> ReadBack | None:
            size = self.device.size(device_key)
            if size is None:
                return None
            buffer = source(size) if device_key == key else new_buffer(size)
            assert buffer.nbytes == size, (buffer.nbytes, size)
            payload_checksum = PayloadChecksum()
            got = self.device.get_streamed(device_key, buffer, payload_checksum)
            return None if got is None else ReadBack(buffer[:got], payload_checksum.intdigest())

        return read_part

    def _attempt(self, op: TierOp) -> Attempt:
        """The breaker's attempt for one ``op``; one not allowed is counted as skipped."""
        attempt = self.breaker.attempt()
        if not attempt.allowed:
            self.metrics.outcome(op, Outcome.SKIPPED)
        return attempt

    def _admit(
        self,
        entry: Entry,
        pinned: frozenset[bytes],
        on_evict: Callable[[Sequence[Entry]], None] | None,
        behind: bool = False,
    ) -> bool:
        """Have the index take ``entry``, handing what it lets go to ``on_evict`` and
        then deleting those bytes; False (said and counted, unless ``behind``: see
        `write`) if it cannot."""
        try:
            victims = self.index.admit(entry, self.capacity_bytes, pinned, behind)
        except DeviceError as err:
            self._index_fault(err)
            return False
        except OverBudget as err:
            return False if behind else self._unstorable(err)
        if victims:
            if on_evict is not None:
                on_evict(victims)
            self.drop(victims)
        return True

    def _unstorable(self, err: Exception) -> bool:
        """A value this tier cannot take (too large, too many fragments); always False.

        Nothing reached the device, so there is no outcome to judge: the attempt
        this runs under hands a half-open breaker's trial back when it ends.
        """
        self._once.say(f"unstorable:{self.name}", f"tier '{self.name}': {err}; not stored")
        return False

    def _stored(self, entry: Entry) -> bool:
        """A value is stored: the tier is not full, and answers."""
        self._once.clear(f"full:{self.name}")
        self._ok()
        self.metrics.stored(entry.nbytes)
        return True

    def _entry_of(self, key: bytes, fingerprint: bytes, parts: Sequence[EncodedPart]) -> Entry:
        """The index entry of a value stored as ``parts``: their bytes, and what the device
        takes beyond them (`kvharbor.hal.base.Device.allocation_bytes`), which the budget counts."""
        sizes = [part.nbytes for part in parts]
        slack = sum(self.device.allocation_bytes(n) - n for n in sizes)
        assert slack >= 0, slack
        return Entry(bytes(key), sum(sizes), len(sizes), bytes(fingerprint), slack)

    def _least_recent(self, nbytes: int, pinned: frozenset[bytes]) -> list[Entry]:
        """Take least recently used entries that take at least ``nbytes`` of the device out
        of the index (never ``pinned`` ones); the caller drops their bytes."""
        for limit in LRU_SCAN_ENTRIES:
            candidates = self.index.lru(limit)
            victims: list[Entry] = []
            freed = 0
            for candidate in candidates:
                if freed >= nbytes:
                    break
                if candidate.key not in pinned:
                    victims.append(candidate)
                    freed += candidate.allocated_bytes
            if freed >= nbytes or len(candidates) < limit:
                break
        self.index.remove([victim.key for victim in victims])
        return victims

    def _forget(self, entry: Entry) -> None:
        self._remove_from_index([entry.key])
        self._delete_parts(entry.key, entry.parts)

    def _delete_parts(self, key: bytes, parts: int) -> None:
        for index in range(parts):
            device_key = key if index == 0 else fragment_key(key, index)
            self._delete_quietly(device_key)

    def _delete_quietly(self, device_key: bytes) -> bool:
        """Delete one device object; a fault is fed to the breaker, not raised."""
        try:
            with self.metrics.duration[TierOp.DELETE].time():
                deleted = self.device.delete(device_key)
        except DeviceError as err:
            self._fault(TierOp.DELETE, err)
            return False
        self.metrics.outcome(TierOp.DELETE, Outcome.OK if deleted else Outcome.MISS)
        return deleted

    def _stored_fingerprint(self, fingerprint: bytes) -> bytes:
        """The fingerprint this tier stores ``fingerprint``'s objects under (see ``layout``)."""
        if not self.layout:
            return fingerprint
        stored = self._stored_fingerprints.get(fingerprint)
        if stored is None:
            stored = tier_fingerprint(fingerprint, self.layout)
            self._stored_fingerprints[bytes(fingerprint)] = stored
            self._engine_fingerprints[stored] = bytes(fingerprint)
        return stored

    def _corrupt(self, key: bytes, err: CorruptObject) -> Outcome:
        """Count, say (once per tier, then counted: damage comes in runs) and drop a damaged
        object; the device answered, so it is not sick. Returns the outcome a get that found
        it ends with.

        On a tier with a ``layout`` of its own, an intact object of another layout
        is stale, not damaged (the tier's settings changed since it was stored):
        counted as such and said once, not per object. Elsewhere keys embed the
        layout, so a key under another layout is damage. An object of another format
        version is neither (`_foreign`).
        """
        if isinstance(err, ForeignFormat):
            return self._foreign(err)
        outcome = Outcome.CORRUPT
        if isinstance(err, ForeignLayout) and self.layout:
            outcome = Outcome.STALE
            self.metrics.stale()
            self._once.say(
                f"stale:{self.name}",
                f"tier '{self.name}' holds objects stored under other settings of it; they are misses, dropped",
            )
        else:
            self.metrics.corrupt()
            self._once.say(
                f"corrupt:{self.name}", f"corrupt chunk {key.hex()} in tier '{self.name}' ({err}) -> treated as miss"
            )
        self.delete([key])
        self._ok()
        return outcome

    def _foreign(self, err: ForeignFormat) -> Outcome:
        """An object of another format version: another release's, so a miss, said once per
        tier and version, and left where it is (nor counted corrupt or stale: nothing is
        wrong with it). The device answered, so it is not sick."""
        self._once.say(
            f"foreign:{self.name}:{err.version}",
            f"tier '{self.name}' holds objects of format version {err.version} (another release; "
            f"this one reads {FORMAT_VERSION}); they are misses here, left in place",
        )
        self._ok()
        return Outcome.MISS

    def _held_by_another_release(self, key: bytes) -> bool:
        """Whether ``key``'s object on this device is of another format version (`write`'s
        rule). Only a device that outlives the process can hold one, and only a key the
        index holds is looked at (recovery indexes every object it finds, another
        release's too): a write of a new key costs no device command."""
        if not isinstance(self.device, PersistentDevice):
            return False
        try:
            if not self.index.contains([key])[0]:
                return False
            head = memoryview(bytearray(HEADER_BYTES))
            got = self.device.peek(key, head)
        except DeviceError:
            return False  # The write meets the fault itself, and reports it.
        if got is None:
            return False
        try:
            parse_header(head[:got])
        except ForeignFormat as err:
            self._foreign(err)
            self._once.say(
                f"foreign-write:{self.name}",
                f"tier '{self.name}': a key held by an object of format version {err.version} "
                "(another release) is not replaced; this release does not store it there",
            )
            return True
        except CorruptObject:
            return False  # Damage: the write replaces it.
        return False

    def _verify_shared(self, key: bytes, fingerprint: bytes, parts: int) -> bool:
        """Verify a value just written to shared memory, in the copy readers will see.

        The source was a client-writable ring: a client that changed it while
        it was stored would otherwise leave bytes that disagree with their
        checksum where hits are served without one.
        """
        device = self.device
        if not isinstance(device, SharedSpans):
            return True
        for index in range(parts):
            span = device.pin(key if index == 0 else fragment_key(key, index))
            if span is None:
                return False  # Replaced or evicted meanwhile by another writer.
            try:
                verify_part(device.view(span), key, fingerprint, index)
            except CorruptObject as err:
                self._corrupt(key, err)
                return False
            finally:
                device.unpin(span)
        return True

    def _remove_from_index(self, keys: Sequence[bytes]) -> None:
        try:
            self.index.remove(keys)
        except DeviceError as err:
            self._index_fault(err)

    def _index_fault(self, err: DeviceError) -> None:
        """The index (a manifest on disk) failed: a fault like any other, and a
        damaged manifest is rebuilt from the device."""
        self._fault(TierOp.INDEX, err)
        if isinstance(err, DeviceCorrupt) and self._reopen_index is not None:
            _log.warning("kvharbor: tier '%s': index damaged (%s); rebuilding it", self.name, err)
            try:
                self.index.close()
                self.index = self._reopen_index()
            except DeviceError as again:
                self._fault(TierOp.INDEX, again, "index rebuild")

    def _ok(self) -> None:
        before = self.breaker.state
        if self.breaker.record(True) is BreakerState.CLOSED and before is not BreakerState.CLOSED:
            self._once.clear(f"fault:{self.name}")
            self._once.clear(f"open:{self.name}", f"tier '{self.name}' answers again; breaker closed")

    def _fault(self, op: TierOp, err: DeviceError, operation: str = "") -> None:
        """A device fault in ``op``: counted, fed to the breaker, said once (naming
        ``operation``, by default what ``op`` asks of the device)."""
        self.metrics.outcome(op, Outcome.ERROR)
        operation = operation or _DEVICE_VERBS[op]
        if isinstance(err, TargetUnreachable):
            # The device says it is gone (a card's target restarting): unavailable now,
            # probed again after the breaker's wait, not after a window of failures.
            self.breaker.trip()
            self._once.say(
                f"open:{self.name}",
                f"tier '{self.name}' unavailable ({err}); the others serve; "
                f"probing it again in {self.breaker.wait_s:g} s, backing off",
                logging.ERROR,
            )
            return
        state = self.breaker.record(False)
        self._once.say(f"fault:{self.name}", f"tier '{self.name}' {operation} failed: {err}; treated as a miss")
        if state is BreakerState.OPEN:
            self._once.say(
                f"open:{self.name}",
                f"tier '{self.name}' circuit breaker open: more than "
                f"{self.breaker.settings.failure_ratio:.0%} of its operations failed; "
                f"skipped for {self.breaker.wait_s:g} s",
                logging.ERROR,
            )
