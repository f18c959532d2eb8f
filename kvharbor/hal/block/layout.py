"""The on-disk format of the block store: a superblock, regions, objects.

::

    block 0          superblock: magic, version, geometry, store id, checksum
    region i         at SUPERBLOCK_BYTES + i * region_bytes
      block 0        region header: magic, index, sequence, store id, checksum
      then objects   each at a BLOCK_BYTES-aligned offset, padded to a whole block:
                     object header (OBJECT_HEADER_BYTES) then the value, or
                     (a split value, `ValueLayout`) its head, then from the
                     next block edge its body

A region is a log: objects are appended until the next does not fit, then the
store opens another region with a higher sequence. An object belongs to its
region's current generation only if its header names that sequence; bytes of an
older generation left after the tail are never taken for objects.

Every header checksum is xxh3-64 seeded with a value derived from the store id,
so a region or object left by an earlier format of the same file (or another
store's image copied in) fails its checksum instead of being read as ours. An
object's value checksum (`value_checksum`) covers its head and its body apart:
the body's 1 MiB segments (`kvharbor.hal.checksum`) are hashed by whichever
thread read or wrote them, in any order, and a writer that took that checksum
of the body already (a payload in shared memory) hands it over instead of the
store hashing the body again.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from kvharbor.hal.checksum import checksum as body_checksum

BLOCK_BYTES = 4096
"""I/O and alignment unit: every read and write is whole blocks from a block-aligned buffer (O_DIRECT)."""
SUPERBLOCK_BYTES = BLOCK_BYTES
REGION_HEADER_BYTES = BLOCK_BYTES
FORMAT_MAGIC = b"KVHBLOCK"
FORMAT_VERSION = 2
"""2 (2026-12-06): the value checksum over head and body apart (`value_checksum`). 1 was one
xxh3 over the value, a serial pass that a read could take only in chunk order, after the
chunks had landed. A store of an older version is formatted again at open (its objects are
a cache's, which this release cannot verify); a newer one is refused."""
REGION_MAGIC = b"KVHREGN1"
OBJECT_MAGIC = b"KVHO"
MIN_REGIONS = 2
"""One region to append to and one to open next: FIFO eviction needs somewhere to go."""

# magic, version, block bytes, region bytes, region count, device bytes, store id; then the checksum.
_SUPERBLOCK = struct.Struct("<8sIIQQQ16s")
# magic, region index, sequence, store id; then the checksum.
_REGION = struct.Struct("<8sQQ16s")
# magic, kind, 3 pad, region sequence, value bytes, key, value checksum, the value's split (head
# bytes, body offset; 0, 0 for a contiguous value, as every object of the first release is); then the checksum.
_OBJECT = struct.Struct("<4sB3xQQ16sQII")
_CHECKSUM = struct.Struct("<Q")
OBJECT_HEADER_BYTES = _OBJECT.size + _CHECKSUM.size
KEY_BYTES = 16


class LayoutError(ValueError):
    """The bytes at the start of the device are not a block store this code can open."""


class OlderFormat(LayoutError):
    """Block 0 holds a kvharbor block store of an older format version."""

    def __init__(self, version: int, device_bytes: int) -> None:
        super().__init__(f"block store format version {version}, older than {FORMAT_VERSION}")
        self.version = version
        self.device_bytes = device_bytes
        """The size it was formatted for: a new format over it must not claim more."""


class ObjectKind(enum.IntEnum):
    VALUE = 1
    TOMBSTONE = 2
    """A delete: hides older objects of the key when the index is rebuilt."""


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole blocks."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def object_span(value_bytes: int) -> int:
    """Bytes an object of ``value_bytes`` takes in its region (header and padding included)."""
    return round_up(OBJECT_HEADER_BYTES + value_bytes)


@dataclass(frozen=True, slots=True)
class ValueLayout:
    """Where an object's value lies in the object's bytes.

    Contiguous (``body_at`` 0): right after the object header. Split: the first
    ``head_bytes`` right after the header, the rest from ``body_at``, a block
    edge. A put splits a value whose last part the caller holds block-aligned in
    memory, so that part is written from the caller's memory with O_DIRECT
    instead of being copied into the store's aligned buffer
    (`kvharbor.hal.block.pipeline`).
    """

    value_bytes: int
    head_bytes: int = 0
    body_at: int = 0

    @property
    def valid(self) -> bool:
        """False for a split no put writes (a damaged or foreign header that passed its checksum)."""
        if not self.body_at:
            return self.head_bytes == 0
        return (
            self.body_at % BLOCK_BYTES == 0
            and self.head_bytes <= self.value_bytes
            and OBJECT_HEADER_BYTES + self.head_bytes <= self.body_at
        )

    def ranges(self, nbytes: int | None = None) -> list[tuple[int, int]]:
        """Offsets in the object of the value's first ``nbytes`` (all: None), in value order,
        empty ones left out."""
        n = self.value_bytes if nbytes is None else min(nbytes, self.value_bytes)
        if not self.body_at:
            return [(OBJECT_HEADER_BYTES, OBJECT_HEADER_BYTES + n)] if n else []
        head = min(n, self.head_bytes)
        ranges = [(OBJECT_HEADER_BYTES, OBJECT_HEADER_BYTES + head), (self.body_at, self.body_at + n - head)]
        return [(a, b) for a, b in ranges if b > a]

    @property
    def halves(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The value's head and body, as ``[lo, hi)`` in the object, that `value_checksum`
        covers apart: a split value's head is its first ``head_bytes``, a contiguous value's
        head is empty (at the value's start) and its body all of it."""
        head_end = OBJECT_HEADER_BYTES + self.head_bytes
        body_at = self.body_at or head_end
        return (OBJECT_HEADER_BYTES, head_end), (body_at, body_at + self.value_bytes - self.head_bytes)

    @property
    def span(self) -> int:
        """Bytes the object takes in its region (header and padding included)."""
        if not self.body_at:
            return object_span(self.value_bytes)
        return round_up(self.body_at + self.value_bytes - self.head_bytes)


def checksum(data: bytes | memoryview, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed)


_HALVES = struct.Struct("<QQ")


def value_checksum(head_digest: int, body_digest: int, seed: int) -> int:
    """The checksum of a value from its two halves' (`ValueLayout.halves`)::

    head_digest = xxh3_64(head, seed)
    body_digest = kvharbor.hal.checksum.checksum(body)     (1 MiB segments)
    value_checksum = xxh3_64(le_u64(head_digest) || le_u64(body_digest), seed)
    """
    return checksum(_HALVES.pack(head_digest, body_digest), seed)


def whole_value_checksum(value: bytes | memoryview, head_bytes: int, seed: int) -> int:
    """`value_checksum` of ``value`` in one call: for tests and tools, not the data path."""
    view = memoryview(value)
    return value_checksum(checksum(view[:head_bytes], seed), body_checksum(view[head_bytes:]), seed)


@dataclass(frozen=True, slots=True)
class Superblock:
    region_bytes: int
    region_count: int
    device_bytes: int
    """The size the store was formatted for; the device must still have it."""
    store_id: bytes

    @property
    def seed(self) -> int:
        """Seed of every checksum of this store (see the module docstring)."""
        return xxhash.xxh3_64_intdigest(self.store_id)

    def region_offset(self, region: int) -> int:
        assert 0 <= region < self.region_count, region
        return SUPERBLOCK_BYTES + region * self.region_bytes

    def encode(self) -> bytes:
        body = _SUPERBLOCK.pack(
            FORMAT_MAGIC,
            FORMAT_VERSION,
            BLOCK_BYTES,
            self.region_bytes,
            self.region_count,
            self.device_bytes,
            self.store_id,
        )
        return _pad(body + _CHECKSUM.pack(checksum(body, 0)), SUPERBLOCK_BYTES)

    @classmethod
    def decode(cls, block: bytes | memoryview, where: str) -> Superblock:
        """Parse block 0 of ``where``; raises `LayoutError` saying what it holds instead."""
        raw = bytes(block[: _SUPERBLOCK.size + _CHECKSUM.size])
        magic, version, block_bytes, region_bytes, region_count, device_bytes, store_id = _SUPERBLOCK.unpack(
            raw[: _SUPERBLOCK.size]
        )
        if magic != FORMAT_MAGIC:
            raise LayoutError(
                f"{where} belongs to another format (first bytes {bytes(block[:8])!r}, not a kvharbor block "
                "store); give block mode an empty file or device, or wipe this one"
            )
        (stored,) = _CHECKSUM.unpack(raw[_SUPERBLOCK.size :])
        if stored != checksum(raw[: _SUPERBLOCK.size], 0):
            raise LayoutError(f"{where}: the block store's superblock is damaged (checksum mismatch)")
        if version < FORMAT_VERSION:
            raise OlderFormat(version, device_bytes)
        if version != FORMAT_VERSION:
            raise LayoutError(
                f"{where}: a newer kvharbor's block store (format version {version}; this release reads "
                f"version {FORMAT_VERSION}); use that release, or give block mode another file or device"
            )
        if block_bytes != BLOCK_BYTES or region_bytes % BLOCK_BYTES or region_count < MIN_REGIONS:
            raise LayoutError(f"{where}: the block store's superblock has an impossible geometry")
        return cls(region_bytes, region_count, device_bytes, store_id)


@dataclass(frozen=True, slots=True)
class RegionHeader:
    region: int
    seq: int
    """Generation of the region's contents: higher is newer, 0 never appears on disk."""

    def encode(self, store: Superblock) -> bytes:
        body = _REGION.pack(REGION_MAGIC, self.region, self.seq, store.store_id)
        return _pad(body + _CHECKSUM.pack(checksum(body, store.seed)), REGION_HEADER_BYTES)

    @classmethod
    def decode(cls, block: bytes | memoryview, store: Superblock, region: int) -> RegionHeader | None:
        """The header of ``region``, or None where the block holds none of this store's."""
        raw = bytes(block[: _REGION.size + _CHECKSUM.size])
        magic, index, seq, store_id = _REGION.unpack(raw[: _REGION.size])
        (stored,) = _CHECKSUM.unpack(raw[_REGION.size :])
        valid = (
            magic == REGION_MAGIC
            and store_id == store.store_id
            and index == region
            and seq > 0
            and stored == checksum(raw[: _REGION.size], store.seed)
        )
        return cls(region, seq) if valid else None


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    kind: ObjectKind
    region_seq: int
    value_bytes: int
    key: bytes
    value_checksum: int
    head_bytes: int = 0
    body_at: int = 0
    """The value's split (`ValueLayout`); 0, 0: contiguous."""

    @property
    def layout(self) -> ValueLayout:
        return ValueLayout(self.value_bytes, self.head_bytes, self.body_at)

    def encode_into(self, into: memoryview, seed: int) -> None:
        body = _OBJECT.pack(
            OBJECT_MAGIC,
            self.kind,
            self.region_seq,
            self.value_bytes,
            self.key,
            self.value_checksum,
            self.head_bytes,
            self.body_at,
        )
        into[: _OBJECT.size] = body
        into[_OBJECT.size : OBJECT_HEADER_BYTES] = _CHECKSUM.pack(checksum(body, seed))

    @classmethod
    def decode(cls, raw: bytes | memoryview, seed: int, region_seq: int) -> ObjectHeader | None:
        """The object header in ``raw``, or None where there is none of this region generation
        (the end of the region's log, a torn header, bytes of an older generation)."""
        body = bytes(raw[: _OBJECT.size])
        (stored,) = _CHECKSUM.unpack(raw[_OBJECT.size : OBJECT_HEADER_BYTES])
        if body[:4] != OBJECT_MAGIC or stored != checksum(body, seed):
            return None
        _, kind, seq, value_bytes, key, value_checksum, head_bytes, body_at = _OBJECT.unpack(body)
        if seq != region_seq or kind not in ObjectKind._value2member_map_:
            return None
        header = cls(ObjectKind(kind), seq, value_bytes, key, value_checksum, head_bytes, body_at)
        return header if header.layout.valid else None


def _pad(data: bytes, size: int) -> bytes:
    assert len(data) <= size, (len(data), size)
    return data + bytes(size - len(data))
