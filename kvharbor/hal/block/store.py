"""A log-structured store on a file or block device: the card's behaviour on an ordinary SSD.

The device (see `kvharbor.hal.block.layout`) is cut into fixed regions of
``region_bytes``. Puts append an object (header and value, one O_DIRECT write
from an aligned buffer) to the open region; when the next object does not fit,
the store opens another region. Which region that is gives the card's two
behaviours:

- a free region (never used, or whose objects were all replaced or deleted);
- otherwise, with key eviction on, the oldest region (FIFO): its keys leave the
  index (an `DeviceEventKind.EVICTED` event says how many);
- otherwise, with key eviction off, the put is refused as card full
  (`DeviceFull`; event 3002 once per episode, as a card's service logs it).

The index (key -> place) lives in memory and is rebuilt at open from the region
headers and the object headers they are followed by, newest region last; a
delete appends a tombstone so a deleted key stays deleted after a restart.

Crash safety: appends are serialised and an object is acknowledged only after
its write (and ``fdatasync`` when ``fsync`` is on) returned, so only the last
object of the newest region can be torn by a crash; the rebuild verifies that
one's value checksum and drops it if torn. Every read verifies the object's
header (key, length, region generation) and value checksum; a mismatch is a
miss, counted and logged once, never wrong bytes. A read races a region being
reused only by finding another generation there, which fails verification; the
key is then looked up again.

One process opens a store at a time (an exclusive ``flock``): two appenders on
one log would overwrite each other's objects.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvharbor.hal.base import (
    STREAM_SLICE_BYTES,
    Buffer,
    BufferTooSmall,
    CapacityUsage,
    CardDevice,
    CardEventRecord,
    CardStatus,
    ChecksummedPuts,
    Device,
    DeviceEvent,
    DeviceEventKind,
    DeviceFull,
    DeviceInUse,
    DeviceUnavailable,
    EventSource,
    Health,
    HealthState,
    PieceConsumer,
    SelfDescribingDevice,
    SliceConsumer,
    Usage,
    hand_out,
)
from kvharbor.hal.block.direct import AlignedBuffer, BufferPool, Opened, block_aligned, open_direct, pwrite_full
from kvharbor.hal.block.layout import (
    BLOCK_BYTES,
    FORMAT_VERSION,
    KEY_BYTES,
    MIN_REGIONS,
    OBJECT_HEADER_BYTES,
    REGION_HEADER_BYTES,
    SUPERBLOCK_BYTES,
    LayoutError,
    ObjectHeader,
    ObjectKind,
    OlderFormat,
    RegionHeader,
    Superblock,
    ValueLayout,
    object_span,
    round_up,
)
from kvharbor.hal.block.pipeline import ObjectRead, read_object, write_object
from kvharbor.hal.checksum import SEGMENT_BYTES
from kvharbor.hal.posix import device_error, read_into
from kvharbor.hal.sim.events import CardEventCode, CardEventLog
from kvharbor.telemetry.log import PREFIX, OnceLog, get_logger

_log = get_logger("kvharbor.hal.block")

DRIVER_NAME = "kvharbor-block"
REGION_BYTES_DEFAULT = 256 * 1024 * 1024
"""Large against a value (the card's fragments are 2 MiB) so that padding and the
region header cost little, small against the device so FIFO eviction drops a small share."""
WARNING_USAGE_RATIO = 0.80
CRITICAL_USAGE_RATIO = 0.95
"""Shares of the regions in use at which CapacityUsage reads WARNING and CRITICAL."""
READ_ATTEMPTS = 3
"""Lookups of one get when the key moved while it was read (replaced, region reused)."""
EVENTS_MAX = 1000
IO_THREADS = 8
"""Threads doing the chunks' I/O (`kvharbor.hal.block.pipeline`), so chunk requests in flight at
once: one at a time would leave the device's queue (and its parallel flash channels) idle between
chunks; eight of up to 4 MiB (`pipeline.CHUNK_BYTES`) keep about as much in flight as one 32 MiB request does (the
kernel cuts it into 4 MiB requests, all queued)."""
IN_PLACE_MIN_BYTES = 1024 * 1024
"""Smallest last part written from the caller's memory (`ValueLayout`): below it the copy costs
little and the split's padding block more, in proportion."""


@dataclass(slots=True)
class _Region:
    """What the store knows of one region's current generation (mutable, under the index lock)."""

    seq: int = 0
    """0: free."""
    tail: int = REGION_HEADER_BYTES
    """Offset in the region where the next object goes."""
    keys: set[bytes] = field(default_factory=set)
    """Keys whose current object is here."""
    tombstones: int = 0

    def reset(self, seq: int) -> None:
        self.seq, self.tail, self.keys, self.tombstones = seq, REGION_HEADER_BYTES, set(), 0


@dataclass(frozen=True, slots=True)
class _Place:
    region: int
    offset: int
    """Of the object header, from the start of the device."""
    layout: ValueLayout
    region_seq: int

    @property
    def value_bytes(self) -> int:
        return self.layout.value_bytes


class BlockStoreDevice(Device, ChecksummedPuts, CardDevice, EventSource, SelfDescribingDevice):
    def __init__(
        self,
        name: str,
        path: str,
        max_value_bytes: int,
        *,
        region_bytes: int = REGION_BYTES_DEFAULT,
        create_bytes: int | None = None,
        key_eviction: bool = True,
        fsync: bool = True,
        exclusive: bool = True,
    ) -> None:
        """Open the block store on ``path`` (a file or a block device).

        An empty device (block 0 all zeros) is formatted with ``region_bytes``
        regions; an absent file is created with ``create_bytes`` first. A store
        keeps the geometry it was formatted with. Raises `LayoutError` (a
        ValueError) naming the path for a device of another format or too small,
        ValueError for a ``region_bytes`` that cannot hold a value of
        ``max_value_bytes``, `DeviceUnavailable` when it cannot be opened
        (`DeviceInUse` when another process holds it). ``exclusive`` False skips the lock: only for a forced
        wipe (``kvharbor card wipe --force``) beside a process that holds it.
        """
        super().__init__(name, max_value_bytes)
        if region_bytes % BLOCK_BYTES or object_span(max_value_bytes) > region_bytes - REGION_HEADER_BYTES:
            raise ValueError(
                f"tier '{name}': region_bytes {region_bytes} must be a multiple of {BLOCK_BYTES} and hold "
                f"a region header and one value of max_value_bytes {max_value_bytes} "
                f"(at least {REGION_HEADER_BYTES + object_span(max_value_bytes)})"
            )
        self.path = path
        self.fsync = fsync
        self.key_eviction = key_eviction
        self._once = OnceLog(_log)
        self._opened = _open_exclusive(name, path, create_bytes, exclusive)
        self._fd = self._opened.fd
        try:
            self.store = self._superblock(region_bytes)
        except BaseException:
            os.close(self._fd)
            raise
        # Append staging: a first object of a region goes out with the region header in one write.
        self._staging = AlignedBuffer(REGION_HEADER_BYTES + object_span(max_value_bytes))
        self._reads = BufferPool(object_span(max_value_bytes))
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix=f"kvharbor-block-{name}")
        self._append_lock = threading.Lock()
        """Serialises appends (held during their I/O): one tail, and at most one torn object."""
        self._lock = threading.Lock()
        """Guards the index and the regions; never held during I/O."""
        self._index: dict[bytes, _Place] = {}
        self._regions = [_Region() for _ in range(self.store.region_count)]
        self._order: deque[int] = deque()
        """Regions in use, oldest first; the last is the one appended to."""
        self._seq = 0
        self._full = False
        self._counts: Counter[str] = Counter()
        self._events = CardEventLog(EVENTS_MAX)
        self._pending: list[DeviceEvent] = []
        if not self._opened.direct:
            _log.warning(
                "%stier '%s': %s refuses O_DIRECT (ramfs, FUSE, old tmpfs); "
                "block mode uses buffered I/O with fdatasync there",
                PREFIX,
                name,
                path,
            )
        try:
            self._rebuild()
        except OSError as err:
            self.close()
            raise device_error(name, err, f"rebuild the index of {path}") from err

    @property
    def direct_io(self) -> bool:
        """False where the filesystem refused O_DIRECT and the store uses buffered I/O."""
        return self._opened.direct

    # -- the device protocol -----------------------------------------------------

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        self._append(ObjectKind.VALUE, key, [memoryview(p).cast("B") for p in parts], total)

    def put_checksummed(self, key: bytes, parts: Sequence[Buffer], last_part_checksum: int) -> None:
        """A value whose last part is written from the caller's memory (see `_layout`) takes
        ``last_part_checksum`` as its body's; otherwise the value is hashed as by `put`."""
        total = self.check_value_size(parts)
        self._append(ObjectKind.VALUE, key, [memoryview(p).cast("B") for p in parts], total, last_part_checksum)

    def get(self, key: bytes, into: memoryview) -> int | None:
        found = self._read_verified(key, _bytes_view(into))
        return None if found is None else found[0].value_bytes

    def get_streamed(
        self, key: bytes, into: memoryview, consume: SliceConsumer, slice_bytes: int = STREAM_SLICE_BYTES
    ) -> int | None:
        """The value is read into ``into`` and verified whole before ``consume`` sees any of
        it: a slice handed out is never one of a value that then fails its checksum. A
        `PieceConsumer` whose pieces are the value's body segments (the head is its first
        piece: a cache object put as header and payload) is handed the digests the read took
        (`PieceConsumer.take_digest`) instead of the bytes to hash again."""
        view = _bytes_view(into)
        found = self._read_verified(key, view)
        if found is None:
            return None
        layout, read = found
        value = view[: layout.value_bytes]
        if isinstance(consume, PieceConsumer) and _pieces_are_segments(consume, layout):
            if layout.head_bytes:
                consume.take(0, value[: layout.head_bytes])
            for k, digest in enumerate(read.body_digests):
                at = layout.head_bytes + k * SEGMENT_BYTES
                consume.take_digest(at, min(SEGMENT_BYTES, layout.value_bytes - at), digest)
        else:
            hand_out(value, consume, slice_bytes)
        return layout.value_bytes

    def peek(self, key: bytes, into: memoryview) -> int | None:
        """Reads only the blocks the prefix lies in, so that rebuilding a cache index from
        the objects' own headers does not read the whole device. The object header
        (key, length, generation) is verified; the value checksum, which covers the whole
        value, is left to `get`: what a prefix holds (the cache's object header) carries
        its own checksum."""
        view = _bytes_view(into)
        with self._lock:
            place = self._index.get(key)
        if place is None:
            return None
        ranges = place.layout.ranges(view.nbytes)
        buffer = self._reads.take()
        try:
            head = buffer.view[: round_up(max([OBJECT_HEADER_BYTES, *(b for _, b in ranges)]))]
            try:
                got = read_into(self._fd, head, place.offset)
            except OSError as err:
                raise device_error(self.name, err, f"read {self.path}") from err
            header = ObjectHeader.decode(head, self.store.seed, place.region_seq)
            if (
                got != head.nbytes
                or header is None
                or header.kind is not ObjectKind.VALUE
                or header.key != key
                or header.layout != place.layout
            ):
                return None  # Replaced or evicted since the lookup; `get` says which.
            n = 0
            for a, b in ranges:
                view[n : n + b - a] = head[a:b]
                n += b - a
        finally:
            self._reads.give(buffer)
        return n

    def size(self, key: bytes) -> int | None:
        with self._lock:
            place = self._index.get(key)
        return None if place is None else place.value_bytes

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            place = self._index.pop(key, None)
            if place is None:
                return False
            self._regions[place.region].keys.discard(key)
        try:
            # The tombstone keeps the key deleted across a restart; the index forgot it already.
            self._append(ObjectKind.TOMBSTONE, key, [], 0)
        except DeviceFull:
            self._once.say(
                "tombstone",
                f"tier '{self.name}': {self.path} is full; a deleted key may come back after a restart "
                "(its value, never another's)",
            )
        return True

    def scan(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            items = [(key, place.value_bytes) for key, place in self._index.items()]
        yield from items

    def usage(self) -> Usage:
        """Physical usage: the bytes of the regions' current generations (dead objects and
        padding included, as a card counts them); capacity is all regions."""
        with self._lock:
            used = sum(self._regions[r].tail for r in self._order)
            return Usage(used, self.store.region_count * self.store.region_bytes, len(self._index))

    def health(self) -> Health:
        level = self._capacity_usage()
        if self._full and not self.key_eviction:
            return Health(HealthState.DEGRADED, f"{self.path} is full and key eviction is off: writes are refused")
        if level is CapacityUsage.CRITICAL and not self.key_eviction:
            return Health(HealthState.DEGRADED, f"{self.path} is nearly full and key eviction is off")
        return Health(HealthState.OK)

    def close(self) -> None:
        """Release the buffers and the device (and its lock); safe to call twice."""
        if self._fd < 0:
            return
        self._io.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1
        self._staging.close()
        self._reads.close()

    # -- card abilities ----------------------------------------------------------

    def card_status(self) -> CardStatus:
        """What a plain file or block device can say: usage and settings; the flash's own
        health (temperature, spare, wear, supercapacitor) comes from nvme-cli, not from here."""
        usage = self.usage()
        return CardStatus(
            driver=DRIVER_NAME,
            service="running" if self._fd >= 0 else "closed",
            firmware_version="n/a",
            temperature_c=math.nan,
            supercap="n/a",
            flash_spare_percent=math.nan,
            flash_wear_percent=math.nan,
            capacity_usage=self._capacity_usage(),
            used_bytes=usage.used_bytes,
            capacity_bytes=usage.capacity_bytes,
            keys=usage.keys,
            keys_max=usage.capacity_bytes // BLOCK_BYTES,
            key_eviction=self.key_eviction,
            paths=(self.path,),
        )

    def card_events(self, since_seq: int = 0) -> list[CardEventRecord]:
        with self._lock:
            events = self._events.since(since_seq)
        return [CardEventRecord(e.seq, e.time_s, int(e.code), e.code.name.lower(), e.message) for e in events]

    def set_key_eviction(self, enabled: bool) -> None:
        with self._lock:
            if enabled == self.key_eviction:
                return
            self.key_eviction = enabled
            code = CardEventCode.KEY_EVICTION_ON if enabled else CardEventCode.KEY_EVICTION_OFF
            self._events.add(time.time(), code, f"key eviction {'on' if enabled else 'off'}")

    def status_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def drain_events(self) -> list[DeviceEvent]:
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def wipe(self) -> int:
        """Forget every object (returns how many keys were held): a new store id makes every
        region and object on the device another store's (their checksums no longer verify),
        so nothing is rewritten but block 0."""
        with self._append_lock:
            store = Superblock(
                self.store.region_bytes, self.store.region_count, self.store.device_bytes, os.urandom(16)
            )
            self._write_superblock(store)
            with self._lock:
                removed = len(self._index)
                self.store = store
                self._index.clear()
                for region in self._regions:
                    region.reset(0)
                self._order.clear()
                self._full = False
                self._events.add(time.time(), CardEventCode.CARD_WIPED, f"{self.path} wiped: {removed} keys")
        return removed

    # -- appends -----------------------------------------------------------------

    def _append(
        self,
        kind: ObjectKind,
        key: bytes,
        parts: Sequence[memoryview],
        total: int,
        last_part_checksum: int | None = None,
    ) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"{self.name}: keys are {KEY_BYTES} bytes, got {len(key)}")
        layout = self._layout(parts, total)
        span = layout.span
        with self._append_lock:
            with self._lock:
                region, seq = self._room(span)
                tail = self._regions[region].tail
            staging = self._staging.view
            start = 0
            # A region's first object carries its header (again, after a failed first write).
            if tail == REGION_HEADER_BYTES:
                staging[:REGION_HEADER_BYTES] = RegionHeader(region, seq).encode(self.store)
                start = REGION_HEADER_BYTES
            offset = self.store.region_offset(region) + tail - start
            try:
                # The object header goes last, with the head block it shares with the value's
                # start: it needs the value's checksum, and a header on the device then never
                # precedes the value it describes (only fdatasync orders them for a power cut).
                head, value_checksum = write_object(
                    self._io, self._fd, staging, offset, start, layout, parts, self.store.seed, last_part_checksum
                )
                header = ObjectHeader(kind, seq, total, bytes(key), value_checksum, layout.head_bytes, layout.body_at)
                header.encode_into(head[start:], self.store.seed)
                pwrite_full(self._fd, head, offset)
                if self.fsync:
                    os.fdatasync(self._fd)
            except OSError as err:
                # The tail stays: the next append overwrites what this one left.
                raise device_error(self.name, err, f"append to {self.path}") from err
            with self._lock:
                self._full = False
                state = self._regions[region]
                state.tail = tail + span
                if kind is ObjectKind.TOMBSTONE:
                    state.tombstones += 1
                else:
                    self._place(key, _Place(region, offset + start, layout, seq))

    def _layout(self, parts: Sequence[memoryview], total: int) -> ValueLayout:
        """Split where the last part is large and block-aligned in the caller's memory (a payload
        in shared memory, after its cache header) and the split takes no more room than the
        largest value: the part is then written from where it is, never copied."""
        if parts and parts[-1].nbytes >= IN_PLACE_MIN_BYTES and block_aligned(parts[-1]):
            head_bytes = total - parts[-1].nbytes
            split = ValueLayout(total, head_bytes, round_up(OBJECT_HEADER_BYTES + head_bytes))
            if split.span <= object_span(self.max_value_bytes):
                return split
        return ValueLayout(total)

    def _room(self, span: int) -> tuple[int, int]:
        """The region and generation the next object of ``span`` bytes goes to; call under
        the index lock."""
        if self._order:
            active = self._order[-1]
            state = self._regions[active]
            if state.tail + span <= self.store.region_bytes:
                return active, state.seq
        region = self._next_region()
        self._seq += 1
        self._regions[region].reset(self._seq)
        self._order.append(region)
        return region, self._seq

    def _next_region(self) -> int:
        """A free region; else one whose objects are all gone (one holding tombstones only
        when it is the oldest: a tombstone hides objects of older regions); else, with key
        eviction on, the oldest. Raises `DeviceFull` otherwise."""
        for region, state in enumerate(self._regions):
            if state.seq == 0:
                return region
        for position, region in enumerate(self._order):
            state = self._regions[region]
            if not state.keys and (state.tombstones == 0 or position == 0) and position < len(self._order) - 1:
                del self._order[position]
                return region
        if self.key_eviction:
            region = self._order.popleft()
            evicted = self._regions[region].keys
            for key in evicted:
                del self._index[key]
            self._counts["evicted_keys"] += len(evicted)
            self._pending.append(
                DeviceEvent(DeviceEventKind.EVICTED, self.name, f"region {region}: {len(evicted)} keys evicted")
            )
            return region
        self._counts["card_full"] += 1
        if not self._full:
            self._full = True
            message = f"{self.path} full ({len(self._order)} regions in use) and key eviction is off: write refused"
            self._events.add(time.time(), CardEventCode.CARD_FULL, message)
            self._pending.append(DeviceEvent(DeviceEventKind.FULL, self.name, message))
        raise DeviceFull(self.name, f"{self.path} is full and key eviction is off")

    def _place(self, key: bytes, place: _Place) -> None:
        old = self._index.get(key)
        if old is not None:
            self._regions[old.region].keys.discard(key)
        self._index[key] = place
        self._regions[place.region].keys.add(key)

    # -- reads -------------------------------------------------------------------

    def _read_verified(self, key: bytes, room: memoryview) -> tuple[ValueLayout, ObjectRead] | None:
        """The value of ``key`` read into ``room`` (whose bytes are undefined on a miss) and
        verified, with its layout and what the read hashed; None on a miss. Raises
        `BufferTooSmall` when the value exceeds ``room``."""
        for _ in range(READ_ATTEMPTS):
            with self._lock:
                place = self._index.get(key)
            if place is None:
                with self._lock:
                    self._counts["miss"] += 1
                return None
            if place.value_bytes > room.nbytes:
                raise BufferTooSmall(self.name, place.value_bytes, room.nbytes)
            buffer = self._reads.take()
            try:
                read = self._read_object(key, place, buffer, room)
            finally:
                self._reads.give(buffer)
            if read is not None:
                return place.layout, read
            with self._lock:
                if self._index.get(key) != place:
                    continue  # Replaced or evicted while it was read: look again.
                self._index.pop(key)
                self._regions[place.region].keys.discard(key)
                self._counts["checksum_mismatch"] += 1
            self._once.say(
                "mismatch",
                f"tier '{self.name}': an object in {self.path} failed its checksum; "
                "served as a miss (said once, counted as checksum_mismatch)",
            )
            return None
        return None

    def _read_object(
        self, key: bytes, place: _Place, buffer: AlignedBuffer, copy_to: memoryview | None
    ) -> ObjectRead | None:
        """Read the object at ``place`` into ``buffer`` (its value also into ``copy_to``, as it
        is hashed) and verify it: header, key, length, generation and value checksum. None
        where any of them does not match."""
        view = buffer.view[: place.layout.span]
        try:
            read = read_object(
                self._io,
                self._fd,
                view,
                place.offset,
                place.layout,
                self.store.seed,
                copy_to,
                self._opened.memory_align_bytes,
            )
        except OSError as err:
            raise device_error(self.name, err, f"read {self.path}") from err
        header = ObjectHeader.decode(view, self.store.seed, place.region_seq)
        valid = (
            read is not None
            and header is not None
            and header.kind is ObjectKind.VALUE
            and header.key == key
            and header.layout == place.layout
            and header.value_checksum == read.checksum
        )
        return read if valid else None

    # -- opening -----------------------------------------------------------------

    def _superblock(self, region_bytes: int) -> Superblock:
        """Block 0 parsed, or a new store formatted where it is all zeros or holds an older
        format version."""
        block = AlignedBuffer(BLOCK_BYTES)
        try:
            got = read_into(self._fd, block.view, 0)
            first = bytes(block.view[:got])
        finally:
            block.close()
        size = self._opened.size_bytes
        if got == BLOCK_BYTES and any(first):
            try:
                store = Superblock.decode(first, self.path)
            except OlderFormat as older:
                # An earlier release's cache: its objects cannot be verified by this one, and
                # keeping the file unusable until someone wipes it helps nobody.
                _log.warning(
                    "%stier '%s': %s holds a block store of format version %d (an earlier kvharbor); "
                    "formatting it again for version %d: its objects are gone",
                    PREFIX,
                    self.name,
                    self.path,
                    older.version,
                    FORMAT_VERSION,
                )
                return self._format(region_bytes, min(size, older.device_bytes))
            if store.device_bytes > size:
                raise LayoutError(
                    f"{self.path}: the block store was formatted for {store.device_bytes} bytes, "
                    f"the device has {size} (truncated?)"
                )
            return store
        return self._format(region_bytes, size)

    def _format(self, region_bytes: int, size: int) -> Superblock:
        """A new, empty store of ``size`` bytes written to block 0."""
        needed = SUPERBLOCK_BYTES + MIN_REGIONS * region_bytes
        if size < needed:
            raise LayoutError(
                f"{self.path}: {size} bytes is too small for block mode: it needs at least {needed} "
                f"(the superblock and {MIN_REGIONS} regions of region_bytes {region_bytes})"
            )
        store = Superblock(region_bytes, (size - SUPERBLOCK_BYTES) // region_bytes, size, os.urandom(16))
        self._write_superblock(store)
        _log.info(
            "%stier '%s': formatted %s for block mode: %d regions of %d MiB",
            PREFIX,
            self.name,
            self.path,
            store.region_count,
            region_bytes >> 20,
        )
        return store

    def _write_superblock(self, store: Superblock) -> None:
        block = AlignedBuffer(BLOCK_BYTES)
        try:
            block.view[:] = store.encode()
            pwrite_full(self._fd, block.view, 0)
            os.fdatasync(self._fd)
        except OSError as err:
            raise device_error(self.name, err, f"write the superblock of {self.path}") from err
        finally:
            block.close()

    def _rebuild(self) -> None:
        """The index from the region headers and the object headers after them, oldest
        region first (a newer object of a key replaces, a tombstone removes, an older one)."""
        started = time.monotonic()
        block = AlignedBuffer(BLOCK_BYTES)
        try:
            headers = []
            for region in range(self.store.region_count):
                read_into(self._fd, block.view, self.store.region_offset(region))
                header = RegionHeader.decode(block.view, self.store, region)
                if header is not None:
                    headers.append(header)
            for header in sorted(headers, key=lambda h: h.seq):
                self._replay(header, block)
        finally:
            block.close()
        if self._order:
            self._drop_torn_tail(self._order[-1])
        if self._index:
            _log.info(
                "%stier '%s': %d objects in %d regions of %s indexed in %.1f s",
                PREFIX,
                self.name,
                len(self._index),
                len(self._order),
                self.path,
                time.monotonic() - started,
            )

    def _replay(self, header: RegionHeader, block: AlignedBuffer) -> None:
        state = self._regions[header.region]
        state.reset(header.seq)
        self._order.append(header.region)
        self._seq = max(self._seq, header.seq)
        base = self.store.region_offset(header.region)
        while state.tail + object_span(0) <= self.store.region_bytes:
            read_into(self._fd, block.view, base + state.tail)
            found = ObjectHeader.decode(block.view, self.store.seed, header.seq)
            if found is None or state.tail + found.layout.span > self.store.region_bytes:
                return  # The end of this generation's log.
            if found.kind is ObjectKind.TOMBSTONE:
                state.tombstones += 1
                old = self._index.pop(found.key, None)
                if old is not None:
                    self._regions[old.region].keys.discard(found.key)
            else:
                self._place(found.key, _Place(header.region, base + state.tail, found.layout, header.seq))
            state.tail += found.layout.span

    def _drop_torn_tail(self, region: int) -> None:
        """Verify the newest region's last value, the one object a crash can have torn;
        a torn one leaves the index and its place is appended over."""
        state = self._regions[region]
        last = max((self._index[key] for key in state.keys), key=lambda place: place.offset, default=None)
        base = self.store.region_offset(region)
        if last is None or last.offset + last.layout.span != base + state.tail:
            return
        key = next(k for k in state.keys if self._index[k] == last)
        buffer = self._reads.take()
        try:
            intact = self._read_object(key, last, buffer, None) is not None
        finally:
            self._reads.give(buffer)
        if not intact:
            del self._index[key]
            state.keys.discard(key)
            state.tail = last.offset - base
            _log.warning(
                "%stier '%s': the last object in %s was torn by a crash; dropped", PREFIX, self.name, self.path
            )

    # -- internals ---------------------------------------------------------------

    def _capacity_usage(self) -> CapacityUsage:
        with self._lock:
            ratio = len(self._order) / self.store.region_count
        if ratio >= CRITICAL_USAGE_RATIO:
            return CapacityUsage.CRITICAL
        if ratio >= WARNING_USAGE_RATIO:
            return CapacityUsage.WARNING
        return CapacityUsage.OK


def _open_exclusive(name: str, path: str, create_bytes: int | None, exclusive: bool = True) -> Opened:
    """``path`` opened (created with ``create_bytes`` reserved when absent and asked for) and,
    when ``exclusive``, locked."""
    if create_bytes is not None and not os.path.exists(path):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, create_bytes)
            finally:
                os.close(fd)
        except FileExistsError:
            pass  # Another process made it first; it is opened below like any.
        except OSError as err:
            raise device_error(name, err, f"create {path} of {create_bytes} bytes") from err
    try:
        opened = open_direct(path)
    except FileNotFoundError as err:
        raise DeviceUnavailable(name, f"{path} does not exist (give its size to create it)") from err
    except OSError as err:
        raise device_error(name, err, f"open {path}") from err
    if not exclusive:
        return opened
    try:
        fcntl.flock(opened.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(opened.fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DeviceInUse(name, f"{path} is in use by another process") from err
        raise device_error(name, err, f"lock {path}") from err
    return opened


def _pieces_are_segments(consume: PieceConsumer, layout: ValueLayout) -> bool:
    """Whether ``consume``'s pieces are the value's head, then its body's 1 MiB segments (the
    halves `value_checksum` covers), so that the read's digests are theirs."""
    return consume.piece_base == layout.head_bytes and consume.piece_bytes == SEGMENT_BYTES


def _bytes_view(into: memoryview) -> memoryview:
    if into.readonly or not into.contiguous:
        raise ValueError("get needs a writable contiguous buffer")
    return into if into.format == "B" else into.cast("B")
