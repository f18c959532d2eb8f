"""The device protocol: the one interface every storage access goes through.

A device stores opaque values under 16-byte keys. It knows nothing of tokens,
models, engines or the object format; the cache layer above it verifies what
it reads. Drivers: RAM, files (local disk, NFS), S3, NVMe, and the SimPy card.

Contract for every driver:

- ``put`` is atomic: after it returns, ``get`` sees the whole new value; after
  a crash, it sees the old value, the new one, or a miss — never a mix.
- ``get`` copies into the caller's buffer and says how many bytes it wrote; a
  miss is ``None``, never an exception. One ``get`` (and one ``get_streamed``)
  sees one version of the value, even while another process replaces it.
- Errors are typed (`DeviceFull`, `DeviceUnavailable`, `DeviceTransient`,
  `DeviceCorrupt`) so the cache can tell a full card from a dead one; a driver
  never lets an ``OSError`` escape untyped.
- Every call is bounded: a value is at most ``max_value_bytes``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

Buffer: TypeAlias = bytes | bytearray | memoryview
"""Anything that exposes contiguous bytes through the buffer protocol."""

SliceConsumer: TypeAlias = Callable[[memoryview], object]
"""Takes each slice of a value as `Device.get_streamed` fills it in."""


@runtime_checkable
class PieceConsumer(Protocol):
    """A `SliceConsumer` that also takes a value in pieces, in any order and from any thread,
    so that a driver reading on several threads has each thread consume what it just read.

    The pieces of a value of n bytes: ``[0, piece_base)``, then ``[piece_base + k *
    piece_bytes, piece_base + (k + 1) * piece_bytes)`` for k = 0, 1, ..., each clipped to n.
    A driver may hand every piece once (to `take`, or to `take_digest` with its digest)
    instead of the slices to the call, never some of each, and all before
    `Device.get_streamed` returns.
    """

    piece_base: int
    piece_bytes: int

    def __call__(self, data: memoryview, /) -> object: ...

    def take(self, offset: int, data: memoryview) -> None:
        """``data`` is the piece of the value that starts at byte ``offset``."""

    def take_digest(self, offset: int, nbytes: int, digest: int) -> None:
        """The piece of ``nbytes`` that starts at byte ``offset`` was hashed by the driver
        already: ``digest`` is its `kvharbor.hal.checksum.segment_digest` (a driver whose own
        checksum takes the value in the same pieces hands that over instead of the bytes to
        hash again). A piece is given by `take` or by this, once."""


STREAM_SLICE_BYTES = 256 * 1024
"""Slice size of `Device.get_streamed`: small enough that a slice the device just
wrote into the buffer is still in the CPU's L2 cache when the consumer reads it
(hashing a 32 MiB value then costs a cache pass, not a second pass over memory),
large enough that the calls per slice cost little (measured in bench/store.py)."""


class DeviceError(Exception):
    """Base of the typed device errors; ``device`` names the tier or device."""

    def __init__(self, device: str, message: str) -> None:
        super().__init__(f"{device}: {message}")
        self.device = device


class DeviceFull(DeviceError):
    """No room for the value, and the device will not evict on its own."""


class DeviceUnavailable(DeviceError):
    """The device does not answer (unmounted, target gone, process dead)."""


class DeviceInUse(DeviceUnavailable):
    """Another process holds the device exclusively (a block store's ``flock``): a gateway serving it."""


class TargetUnreachable(DeviceUnavailable):
    """The path to the device is gone (an NVMe-oF target that restarts): no operation will
    succeed until it answers again, so the tier is unavailable at once, not after a window
    of failures (see `kvharbor.cache.breaker.CircuitBreaker.trip`)."""


class DeviceTransient(DeviceError):
    """A failure that may pass if retried later (timeout, busy, EINTR-like)."""


class DeviceCorrupt(DeviceError):
    """The device returned bytes it itself knows to be damaged."""


class BufferTooSmall(DeviceError):
    """The caller's buffer cannot hold the value; ``needed`` says how much can."""

    def __init__(self, device: str, needed: int, given: int) -> None:
        super().__init__(device, f"value of {needed} bytes does not fit a buffer of {given}")
        self.needed = needed


class HealthState(enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    """Serving, but something needs attention (nearly full, supercap warning)."""
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Health:
    state: HealthState
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Usage:
    used_bytes: int
    capacity_bytes: int
    """The most the device can hold; for a file tier the space left on its filesystem plus used."""
    keys: int


def hand_out(value: memoryview, consume: SliceConsumer, slice_bytes: int) -> None:
    """Hand ``value`` (in place already) to ``consume`` in consecutive slices of at most
    ``slice_bytes``, in order (`Device.get_streamed`'s slices)."""
    assert slice_bytes > 0, slice_bytes
    for start in range(0, value.nbytes, slice_bytes):
        consume(value[start : start + slice_bytes])


def copy_streamed(source: memoryview, into: memoryview, consume: SliceConsumer, slice_bytes: int) -> int:
    """Copy ``source`` into ``into`` slice by slice, handing each copied slice to
    ``consume`` while it is still in the CPU cache (for drivers that hold values in memory)."""
    assert slice_bytes > 0 and into.nbytes >= source.nbytes
    for start in range(0, source.nbytes, slice_bytes):
        end = min(start + slice_bytes, source.nbytes)
        into[start:end] = source[start:end]
        consume(into[start:end])
    return source.nbytes


class Device(ABC):
    """A key-value store of opaque byte values; see the module docstring."""

    def __init__(self, name: str, max_value_bytes: int) -> None:
        assert max_value_bytes > 0, max_value_bytes
        self.name = name
        self.max_value_bytes = max_value_bytes

    @abstractmethod
    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` under ``key``, replacing any old value.

        Parts let a caller write a header and a payload without joining them.
        """

    @abstractmethod
    def get(self, key: bytes, into: memoryview) -> int | None:
        """Copy the value into ``into`` and return its length, or None on a miss.

        Raises `BufferTooSmall` when ``into`` is shorter than the value.
        """

    def get_streamed(
        self,
        key: bytes,
        into: memoryview,
        consume: SliceConsumer,
        slice_bytes: int = STREAM_SLICE_BYTES,
    ) -> int | None:
        """`get`, handing each part of ``into`` to ``consume`` as soon as it holds its bytes.

        The slices are consecutive views of ``into``, in order, that cover the
        value exactly once, each at most ``slice_bytes`` long; ``consume`` sees
        no slice on a miss. Result, misses and errors are those of `get`, and
        like `get` it reads one version of the value, so the slices never mix an
        old value with a new one. The cache checksums a value slice by slice
        while each is still in the CPU cache, instead of in a second pass. A
        driver that reads on several threads may instead hand a `PieceConsumer`
        its pieces (see there), each from the thread that read it.

        The default gets the whole value, then hands it out: correct for any
        driver; a driver that can read a value in pieces overrides it.
        """
        assert slice_bytes > 0, slice_bytes
        got = self.get(key, into)
        if got is not None:
            view = into.cast("B") if into.format != "B" else into
            hand_out(view[:got], consume, slice_bytes)
        return got

    def peek(self, key: bytes, into: memoryview) -> int | None:
        """Copy the first ``into.nbytes`` bytes of the value (fewer if it is shorter).

        Lets recovery read object headers without reading whole values. The
        default reads the whole value; drivers that can read a range override it.
        """
        size = self.size(key)
        if size is None:
            return None
        whole = memoryview(bytearray(size))
        got = self.get(key, whole)
        if got is None:
            return None
        n = min(got, into.nbytes)
        into[:n] = whole[:n]
        return n

    @abstractmethod
    def size(self, key: bytes) -> int | None:
        """The length of the stored value, or None on a miss."""

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """One flag per key, answered in one batched call."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def scan(self) -> Iterator[tuple[bytes, int]]:
        """Every (key, value length) stored; used to rebuild indexes."""

    @abstractmethod
    def usage(self) -> Usage: ...

    @abstractmethod
    def health(self) -> Health: ...

    def close(self) -> None:  # noqa: B027 - most drivers hold nothing to release.
        """Release handles; the device must not be used afterwards."""

    def allocation_bytes(self, nbytes: int) -> int:
        """The room one value of ``nbytes`` takes on this device, at least ``nbytes``: its
        bytes rounded to the device's unit of allocation. A tier's budget counts this, so
        that its status and its evictions follow what the device really gives up. The
        default, ``nbytes``, is for devices whose rounding is not theirs to tell (a file's
        blocks are the filesystem's); the manifest's budget counts bytes alone."""
        return nbytes

    def check_value_size(self, parts: Sequence[Buffer]) -> int:
        """Total length of ``parts``; raises ValueError above ``max_value_bytes``."""
        total = sum(memoryview(p).nbytes for p in parts)
        if total > self.max_value_bytes:
            raise ValueError(
                f"{self.name}: a value of {total} bytes exceeds max_value_bytes "
                f"{self.max_value_bytes}; the cache layer fragments larger values"
            )
        return total


class DeviceEventKind(enum.Enum):
    FULL = "full"
    """The device refused a write for lack of space (a card's event 3002)."""
    RESTARTED = "restarted"
    """The target went away and came back; its contents may be gone."""
    POWER_FAULT = "power_fault"
    """Power-loss protection (supercapacitor) failed; writes may not be durable."""
    EVICTED = "evicted"
    """The device evicted keys on its own (card key eviction)."""


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    kind: DeviceEventKind
    device: str
    detail: str = ""


class CapacityUsage(enum.Enum):
    """A card's fill level as its service reports it; thresholds are the card's own."""

    OK = "OK"
    WARNING = "WARNING"
    CRITICAL = "CRITICAL"


@dataclass(frozen=True, slots=True)
class CardStatus:
    """A card's aggregated status: what ``kvharbor card status`` shows."""

    driver: str
    service: str
    """The card's own service or target state: ``running``, ``target unreachable``."""
    firmware_version: str
    temperature_c: float
    supercap: str
    """``ok`` or ``failed`` (writes not yet on flash are lost at a power loss)."""
    flash_spare_percent: float
    flash_wear_percent: float
    capacity_usage: CapacityUsage
    used_bytes: int
    capacity_bytes: int
    keys: int
    keys_max: int
    key_eviction: bool
    paths: tuple[str, ...] = ()
    """Paths, namespaces or RAID members where known."""


@dataclass(frozen=True, slots=True)
class CardEventRecord:
    """One entry of a card's own event log (numbers documented by the driver)."""

    seq: int
    time_s: float
    code: int
    name: str
    message: str


class CardDevice(ABC):
    """Mixin for computational-storage cards: aggregated status, the card's event log,
    key eviction switchable while running, and the status codes it answered."""

    evicts_on_its_own: bool = True
    """Whether key eviction on makes the card drop keys by itself (then it, not the tier's
    index, says what is there). False for a card without eviction (an NVMe KV namespace):
    key eviction on is then the tier's own, within its capacity budget."""

    @abstractmethod
    def card_status(self) -> CardStatus: ...

    @abstractmethod
    def card_events(self, since_seq: int = 0) -> list[CardEventRecord]:
        """The card's events after ``since_seq``, oldest first."""

    @abstractmethod
    def set_key_eviction(self, enabled: bool) -> None: ...

    @abstractmethod
    def status_counts(self) -> dict[str, int]:
        """Answers other than success, counted by status code (misses included)."""

    @abstractmethod
    def wipe(self) -> int:
        """Remove every key the card holds (``kvharbor card wipe``); returns how many."""


class EventSource(ABC):
    """Mixin for devices that report asynchronous events (cards, the simulator)."""

    @abstractmethod
    def drain_events(self) -> list[DeviceEvent]:
        """Events since the last call, oldest first."""


class PersistentDevice(ABC):
    """Mixin for devices whose contents outlive the process (files, NVMe, S3).

    ``state_dir`` is a local directory where the cache keeps its index of the
    device (the manifest), beside the data it describes.
    """

    @property
    @abstractmethod
    def state_dir(self) -> str: ...


class PreconditionFailed(DeviceError):
    """A conditional write lost: another host changed (or created) the record first."""


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One value object of a `SharedDevice`, as its listing names it."""

    key: bytes
    nbytes: int
    modified_s: float
    """When it was last written, in the server's clock (Unix seconds)."""


@dataclass(frozen=True, slots=True)
class Record:
    """A small named record of a `SharedDevice` (not a value) and its version."""

    body: bytes
    etag: str
    """The version that a conditional write replacing this one must name."""
    age_s: float
    """Since it was last written, both ends in the server's clock (so hosts whose
    clocks disagree agree on it)."""


class SharedDevice(ABC):
    """Mixin for devices that several hosts share (an object store): what the cache needs
    to keep one budget for all of them (`kvharbor.cache.shared`).

    Values stay the protocol's; beside them the device holds a few named records, written
    with compare-and-swap semantics, so that hosts can agree on who evicts.
    """

    @abstractmethod
    def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key, the length of its value or None, asked in parallel."""

    @abstractmethod
    def listing(self) -> Iterator[StoredObject]:
        """Every value object, with its size and when it was written."""

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove these values (absent ones are no error), in as few requests as the device allows."""

    @abstractmethod
    def read_record(self, name: str) -> Record | None: ...

    @abstractmethod
    def write_record(self, name: str, body: bytes, replaces: str | None) -> str:
        """Write the record ``name`` only if it is absent (``replaces`` None) or still at the
        version ``replaces``; returns the new version, raises `PreconditionFailed` otherwise."""

    @abstractmethod
    def abort_uploads(self, older_than_s: float) -> int:
        """Abort the unfinished uploads begun more than ``older_than_s`` ago (writers that
        died midway); returns how many."""


class SelfDescribingDevice(ABC):  # noqa: B024 - a marker: what it promises is in the protocol.
    """Mixin for devices whose contents outlive the process and that need no index beside
    them (block mode: the store rebuilds its own from the region headers). The cache
    rebuilds a tier's index at open from the objects' own headers (`scan` and `peek`,
    `kvharbor.cache.recovery`), so a restart keeps every value the device still holds."""


class ChecksummedPuts(ABC):
    """Mixin for devices that checksum what they store and can take the checksum of a
    value's last part from the caller instead of hashing it again: a payload's writer took
    `kvharbor.hal.checksum.checksum` of it while the bytes were in its cache (block mode)."""

    @abstractmethod
    def put_checksummed(self, key: bytes, parts: Sequence[Buffer], last_part_checksum: int) -> None:
        """`Device.put`, told ``last_part_checksum``: `kvharbor.hal.checksum.checksum` of
        ``parts[-1]``. The device may store it as it is, so a wrong one makes the value fail
        its check on every read (a miss), never read as valid."""


@dataclass(frozen=True, slots=True)
class SharedSpan:
    """A stored value's place in memory other processes map: ``offset`` and
    ``length`` in the shared segment, pinned until `SharedSpans.unpin`."""

    offset: int
    length: int
    token: object
    """Identifies the pinned object (a later put under the same key is another object)."""


class SharedSpans(ABC):
    """Mixin for devices whose values live in shared memory, so a reader in another
    process can copy a value straight out (one copy; one DMA to a GPU).

    A pinned value is not freed, even when it is deleted or replaced, until it is
    unpinned: the reader's copy can never see the bytes of another value.
    """

    @abstractmethod
    def pin(self, key: bytes) -> SharedSpan | None:
        """The span of ``key``'s value, pinned; None on a miss."""

    @abstractmethod
    def unpin(self, span: SharedSpan) -> None: ...

    @abstractmethod
    def view(self, span: SharedSpan) -> memoryview:
        """The pinned bytes, for the owner to verify."""


class InPlaceWrites(SharedSpans):
    """Mixin for shared-memory devices whose values can be written where they will be
    stored, so a writer in another process fills the final place and nothing copies
    the value again: a put in two phases, like vLLM's prepare/complete stores.

    `reserve` lends room no reader can see; the writer fills `view(span)`; `adopt`
    makes it the object under a key (replacing any older one, which readers that
    pinned it keep until they unpin), or `abandon` gives the room back. Each
    reservation ends in exactly one of the two.
    """

    def writes_in_place(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` can be written in place at all: False for a size
        the device keeps in pages that other objects share (lending it would open them to
        the writer too); such objects are stored with `Device.put`. The default: any size."""
        return nbytes > 0

    @abstractmethod
    def reserve(self, nbytes: int) -> SharedSpan | None:
        """Room for one object of ``nbytes`` (header included), a size `writes_in_place`
        admits (else ValueError); None when there is no room."""

    @abstractmethod
    def adopt(self, key: bytes, span: SharedSpan) -> None:
        """Store the reserved ``span`` under ``key``; from now on readers see it."""

    @abstractmethod
    def abandon(self, span: SharedSpan) -> None:
        """Give back a reservation that will not be adopted."""
