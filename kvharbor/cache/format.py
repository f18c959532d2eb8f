"""The stored object format: a fixed header, then the (maybe compressed) payload.

Every object carries its key, its layout fingerprint digest, lengths and two
checksums, so a reader can prove that the bytes it got are the bytes that were
written for *this* key and *this* layout. Any mismatch raises `CorruptObject`;
the store counts it, treats it as a miss and drops the object.

Header, little-endian, `HEADER_BYTES` (one page) long, its fields first::

    magic "KVHO" | format version u16 | codec u8 | reserved u8
    key 16 B | fingerprint digest 16 B
    fragment index u32 | fragment count u32
    raw length u64 | stored length u64 | payload length u64
    payload checksum u64 (`kvharbor.hal.checksum`) | namespace tag u64
    zero padding up to HEADER_BYTES - 8 | header checksum u64 (xxh3-64, of all bytes before it)

Format 2 pads the header to a page so that the payload starts on a page edge: a value read
whole into page-aligned memory (the gateway's shared segment) lies page-aligned there, for the
engine's copy and for O_DIRECT, and a file's payload sits on the filesystem's block edges.
Format 1 (releases before it) put the checksum right after the fields, 96 bytes in all.
Format 3 changed only the payload checksum: xxh3-64 of the xxh3-64 digests of the payload's
1 MiB segments, where format 2 took one xxh3-64 over the payload, so that readers hash segments
on several threads (`kvharbor.hal.checksum` says why).

The namespace tag (`kvharbor.cache.keys.namespace_tag` of ``engine.key_namespace``)
took the place of 8 reserved bytes of format 1 that were always written as zero: an object
written without one reads as tag 0, `NAMESPACE_UNKNOWN` (``kvharbor purge --namespace``
counts such objects apart and keeps them).

**Mixed releases.** The magic and the version, the first 6 bytes, are where they are in every
format version. An object of another version (older or newer) is another release's, not
damage: `parse_header` raises `ForeignFormat` before it looks at anything else, and readers
treat it as a miss, leave it in place and count it as neither corrupt nor stale (see
`kvharbor.cache.tier` and `kvharbor.cache.recovery`); a version field damaged at rest
reads so too, and is still never served. The version is also part of every
layout fingerprint (`kvharbor.cache.keys.FORMAT_VERSION`), hence of every key: two releases
of different formats never look up or write the same key, so they share a tier without
fighting over objects; each one's objects are the other's misses, and both age out under
the tier's budget like any value.

Why xxh3-64 and not the BLAKE2b of the keys: the checksums run over every byte
read, at tens of GB/s, where BLAKE2b would be the bottleneck (~1 GB/s). It
guards against damage (torn writes, bit rot, truncation), not against an
adversary — keys, which are cryptographic, name the object.

Values longer than a device's ``max_value_bytes`` are split into fragments:
fragment 0 under the key itself, fragment i under `fragment_key(key, i)`;
each carries the parent key, its index and the count, and is verified on its
own before reassembly.

A reader may checksum the payload while it reads it (`PayloadChecksum` fed by
`kvharbor.hal.base.Device.get_streamed`, in order or in pieces, each hashed while still in
the CPU cache) and hand the result to `verify_part` with the bytes (`ReadBack`);
verification is otherwise the same, and nothing is used before it passes.
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import lz4.frame
import xxhash
import zstandard

from kvharbor.cache.keys import FORMAT_VERSION, KEY_BYTES, NAMESPACE_UNKNOWN, ChunkKey, check_key, fragment_key
from kvharbor.hal.base import Buffer, ChecksummedPuts, Device
from kvharbor.hal.checksum import SEGMENT_BYTES, ChecksumStream, checksum, combine, segment_digest

MAGIC = b"KVHO"
_FIELDS = struct.Struct("<4sHBB16s16sIIQQQQQ")
_VERSION = struct.Struct("<4sH")
"""The magic and the version: the part of the header every format version shares."""
HEADER_BYTES = 4096
"""The header's room: its fields, zero padding, its checksum; the payload starts here, a page in."""
_CHECKED_PREFIX = HEADER_BYTES - 8  # Bytes the header checksum covers: fields and padding.
_CHECKSUM = struct.Struct("<Q")
_PADDING = bytes(_CHECKED_PREFIX - _FIELDS.size)
FRAGMENTS_MAX = 1 << 16
"""A value splits into at most this many fragments (a limit, not a format field)."""


class Codec(enum.IntEnum):
    NONE = 0
    LZ4 = 1
    ZSTD = 2

    @classmethod
    def from_name(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            known = ", ".join(c.name.lower() for c in cls)
            raise ValueError(f"unknown codec {name!r}; known: {known}") from None


class CorruptObject(Exception):
    """Bytes that are not a valid object for the expected key and layout."""


class ForeignFormat(CorruptObject):
    """An object of another format version: another release's, not damage. A miss that is
    left in place and counted as neither corrupt nor stale (see the module docstring).

    A subclass of `CorruptObject` so that a path that does not tell it apart still never
    serves it; every path that can meet one (reads, recovery, purge) does tell it apart."""

    def __init__(self, version: int) -> None:
        super().__init__(f"format version {version}, this release reads {FORMAT_VERSION}")
        self.version = version


class ForeignLayout(CorruptObject):
    """An intact object of the expected key written under another layout: stale, not
    damaged (a card tier's fragment size changed since it was stored)."""


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    codec: Codec
    key: bytes
    fingerprint: bytes
    fragment_index: int
    fragment_count: int
    raw_length: int
    stored_length: int
    payload_length: int
    payload_checksum: int
    namespace: int = NAMESPACE_UNKNOWN
    """The writer's namespace tag (`kvharbor.cache.keys.namespace_tag`), or `NAMESPACE_UNKNOWN`."""

    def pack(self) -> bytes:
        fields = _FIELDS.pack(
            MAGIC,
            self.version,
            int(self.codec),
            0,
            self.key,
            self.fingerprint,
            self.fragment_index,
            self.fragment_count,
            self.raw_length,
            self.stored_length,
            self.payload_length,
            self.payload_checksum,
            self.namespace,
        )
        prefix = fields + _PADDING
        return prefix + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(prefix))


@dataclass(frozen=True, slots=True)
class EncodedPart:
    """One device write: ``header`` then ``payload`` under ``device_key``."""

    device_key: ChunkKey
    header: bytes
    payload: memoryview
    payload_checksum: int
    """`kvharbor.hal.checksum.checksum` of ``payload``, as ``header`` records it."""

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes

    def put_on(self, device: Device) -> None:
        """Store the part on ``device``, handing it the payload's checksum where the device
        can take it instead of hashing the payload again (`ChecksummedPuts`)."""
        if isinstance(device, ChecksummedPuts):
            device.put_checksummed(self.device_key, [self.header, self.payload], self.payload_checksum)
        else:
            device.put(self.device_key, [self.header, self.payload])


class PayloadChecksum:
    """`checksum` of an object's payload, taken while the object is read, one of two ways:

    - in order (a `kvharbor.hal.base.SliceConsumer`): called with consecutive slices of the
      whole object; the header's bytes are skipped, every later byte hashed;
    - in pieces (a `kvharbor.hal.base.PieceConsumer`): `take` is given the header piece
      ``[0, piece_base)`` and each payload segment ``[piece_base + k * piece_bytes, ...)``
      (the last one clipped to the object's end), in any order, from any thread; or a
      segment's digest, where the device hashed it already (`take_digest`).

    One object is fed one way. `intdigest` is the payload's checksum once the object's length
    is verified (`verify_part` checks it before it compares checksums).
    """

    __slots__ = ("_pieces", "_skip", "_stream")

    piece_base = HEADER_BYTES
    piece_bytes = SEGMENT_BYTES

    def __init__(self) -> None:
        self._stream = ChecksumStream()
        self._skip = HEADER_BYTES
        self._pieces: dict[int, int] = {}
        """Each payload segment's digest by its index, as `take` was given it."""

    def __call__(self, data: memoryview) -> None:
        if self._pieces:
            raise RuntimeError("PayloadChecksum fed in order after being given pieces")
        if self._skip:
            skipped = min(self._skip, data.nbytes)
            self._skip -= skipped
            data = data[skipped:]
        self._stream.update(data)

    def take(self, offset: int, data: memoryview) -> None:
        """One piece of the object, ``data``, that starts at ``offset`` in it (see the class)."""
        if offset == 0 and data.nbytes <= HEADER_BYTES:
            return  # The header: verified on its own.
        self._pieces[self._segment(offset, data.nbytes)] = segment_digest(data)  # Atomic under the GIL.

    def take_digest(self, offset: int, nbytes: int, digest: int) -> None:
        """A payload segment the device hashed already (`kvharbor.hal.base.PieceConsumer`)."""
        self._pieces[self._segment(offset, nbytes)] = digest

    def _segment(self, offset: int, nbytes: int) -> int:
        """The index of the payload segment of ``nbytes`` at ``offset``; raises ValueError if
        it is not one."""
        index, within = divmod(offset - HEADER_BYTES, SEGMENT_BYTES)
        if offset < HEADER_BYTES or within or not 0 < nbytes <= SEGMENT_BYTES or self._skip < HEADER_BYTES:
            raise ValueError(f"a piece of {nbytes} bytes at {offset} is not one of the object's pieces")
        return index

    def intdigest(self) -> int:
        if not self._pieces:
            return self._stream.intdigest()
        count = len(self._pieces)
        if max(self._pieces) != count - 1:
            return -1  # A segment missing (the read ended early): matches no stored checksum.
        return combine([self._pieces[index] for index in range(count)])


CodecObserver = Callable[[int, int, float], None]
"""Hears each value a codec other than none compressed or decompressed: (raw bytes, stored
bytes, seconds in the codec); how a tier measures its codec's ratio and speed."""

_ZSTD_LEVEL = 3  # zstd's own default: ~300 MB/s+ per core, a good ratio on KV bytes.


def _compress(codec: Codec, data: memoryview, observe: CodecObserver | None = None) -> memoryview:
    if codec is Codec.NONE:
        return data
    started = time.perf_counter()
    if codec is Codec.LZ4:
        out = memoryview(lz4.frame.compress(data, store_size=True))
    else:
        out = memoryview(zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data))
    if observe is not None:
        observe(data.nbytes, out.nbytes, time.perf_counter() - started)
    return out


def _decompress(codec: Codec, data: memoryview, raw_length: int, observe: CodecObserver | None = None) -> memoryview:
    if codec is Codec.NONE:
        # Stored bytes are the value: the lengths must agree, or a header that
        # lies about the raw length would hand out a value of the wrong size.
        if data.nbytes != raw_length:
            raise CorruptObject(f"stored {data.nbytes} bytes, header says the value is {raw_length}")
        return data
    started = time.perf_counter()
    try:
        if codec is Codec.LZ4:
            out = lz4.frame.decompress(data)
        else:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
    except Exception as err:  # Each codec raises its own types on bad input.
        raise CorruptObject(f"{codec.name.lower()} payload does not decompress: {err}") from None
    if len(out) != raw_length:
        raise CorruptObject(f"decompressed {len(out)} bytes, header says {raw_length}")
    if observe is not None:
        observe(raw_length, data.nbytes, time.perf_counter() - started)
    return memoryview(out)


def encode(
    key: bytes,
    fingerprint: bytes,
    value: Buffer,
    codec: Codec = Codec.NONE,
    max_object_bytes: int | None = None,
    value_checksum: int | None = None,
    namespace: int = NAMESPACE_UNKNOWN,
    observe: CodecObserver | None = None,
) -> list[EncodedPart]:
    """The device writes that store ``value``; payloads are views, not copies (codec none).

    ``max_object_bytes`` is the device's largest value (header included); a
    value that does not fit is split into fragments. ``value_checksum`` is
    `checksum` of ``value`` when the caller has it already (its writer took it
    while the bytes were in its cache); it is used when the value is stored as
    it is, in one part. ``namespace`` is the writer's namespace tag, recorded in every
    part's header. ``observe`` hears the compression (see `CodecObserver`).
    """
    check_key(key)
    check_key(fingerprint)
    raw = memoryview(value).cast("B")
    stored = _compress(codec, raw, observe)
    payload_max = (max_object_bytes or (HEADER_BYTES + max(stored.nbytes, 1))) - HEADER_BYTES
    if payload_max <= 0:
        raise ValueError(f"max_object_bytes {max_object_bytes} leaves no room after the header")
    count = max(1, -(-stored.nbytes // payload_max))
    if count > FRAGMENTS_MAX:
        raise ValueError(f"a value of {stored.nbytes} bytes needs {count} fragments (max {FRAGMENTS_MAX})")
    known = value_checksum if codec is Codec.NONE and count == 1 else None  # Payload == value.
    parts = []
    for index in range(count):
        payload = stored[index * payload_max : (index + 1) * payload_max]
        header = Header(
            version=FORMAT_VERSION,
            codec=codec,
            key=bytes(key),
            fingerprint=bytes(fingerprint),
            fragment_index=index,
            fragment_count=count,
            raw_length=raw.nbytes,
            stored_length=stored.nbytes,
            payload_length=payload.nbytes,
            payload_checksum=checksum(payload) if known is None else known,
            namespace=namespace,
        )
        device_key = ChunkKey(bytes(key)) if index == 0 else fragment_key(key, index)
        parts.append(EncodedPart(device_key, header.pack(), payload, header.payload_checksum))
    return parts


def parse_header(data: Buffer) -> Header:
    """The header at the start of ``data``; raises `ForeignFormat` for an object of another
    format version (whatever else it holds), `CorruptObject` on any damage."""
    view = memoryview(data)
    if view.nbytes >= _VERSION.size:
        magic, version = _VERSION.unpack_from(view)
        if magic == MAGIC and version != FORMAT_VERSION:
            raise ForeignFormat(version)  # Its layout past the version is its release's own.
    if view.nbytes < HEADER_BYTES:
        raise CorruptObject(f"object of {view.nbytes} bytes is shorter than its {HEADER_BYTES}-byte header")
    fields = _FIELDS.unpack_from(view)
    if fields[0] != MAGIC:
        raise CorruptObject(f"bad magic {fields[0]!r}")
    (stored_checksum,) = _CHECKSUM.unpack_from(view, _CHECKED_PREFIX)
    if xxhash.xxh3_64_intdigest(view[:_CHECKED_PREFIX]) != stored_checksum:
        raise CorruptObject("header checksum mismatch")
    try:
        codec = Codec(fields[2])
    except ValueError:
        raise CorruptObject(f"unknown codec id {fields[2]}") from None
    return Header(
        version=fields[1],
        codec=codec,
        key=fields[4],
        fingerprint=fields[5],
        fragment_index=fields[6],
        fragment_count=fields[7],
        raw_length=fields[8],
        stored_length=fields[9],
        payload_length=fields[10],
        payload_checksum=fields[11],
        namespace=fields[12],
    )


def verify_part(
    data: memoryview,
    key: bytes,
    fingerprint: bytes,
    index: int,
    first: Header | None = None,
    payload_checksum: int | None = None,
) -> tuple[Header, memoryview]:
    """Check one stored part against what the reader expects; return its payload.

    ``first`` is fragment 0's header: every later fragment must agree with it.
    ``payload_checksum`` is `checksum` of ``data[HEADER_BYTES:]`` when the
    reader computed it as the bytes arrived (`PayloadChecksum`); else it is
    computed here.
    """
    header = check_header(data, key, fingerprint, index, first)
    payload = data[HEADER_BYTES : HEADER_BYTES + header.payload_length]
    if payload_checksum is None:
        payload_checksum = checksum(payload)
    if payload_checksum != header.payload_checksum:
        raise CorruptObject("payload checksum mismatch")
    return header, payload


def check_header(data: memoryview, key: bytes, fingerprint: bytes, index: int, first: Header | None = None) -> Header:
    """Everything `verify_part` checks except the payload checksum.

    Alone, it serves values whose payload was verified when it landed in memory
    no one else can write (`kvharbor.hal.base.SharedSpans`).
    """
    header = parse_header(data)
    if header.key != key:
        raise CorruptObject(f"object holds key {header.key.hex()}, expected {bytes(key).hex()}")
    if header.fingerprint != fingerprint:
        raise ForeignLayout("object was written for another layout (fingerprint mismatch)")
    if header.fragment_index != index:
        raise CorruptObject(f"fragment {header.fragment_index} found where {index} belongs")
    if not 1 <= header.fragment_count <= FRAGMENTS_MAX or index >= header.fragment_count:
        raise CorruptObject(f"fragment count {header.fragment_count} is invalid")
    if first is not None and (
        header.fragment_count,
        header.raw_length,
        header.stored_length,
        header.codec,
    ) != (first.fragment_count, first.raw_length, first.stored_length, first.codec):
        raise CorruptObject(f"fragment {index} disagrees with fragment 0")
    end = HEADER_BYTES + header.payload_length
    if data.nbytes != end:
        raise CorruptObject(f"object is {data.nbytes} bytes, header says {end}")
    return header


class ReadBack(NamedTuple):
    """One stored part as read, with the payload checksum computed on the way."""

    data: memoryview
    """Header and payload."""
    payload_checksum: int
    """`checksum` of ``data[HEADER_BYTES:]`` (`PayloadChecksum`)."""


ReadPart = Callable[[ChunkKey], memoryview | ReadBack | None]
"""Reads one stored part (header and payload) by device key; None on a miss.

A plain view is checksummed by `verify_part`; a `ReadBack` brings its own."""


def _verify_read(
    got: memoryview | ReadBack, key: bytes, fingerprint: bytes, index: int, first: Header | None = None
) -> tuple[Header, memoryview]:
    if isinstance(got, ReadBack):
        return verify_part(got.data, key, fingerprint, index, first, got.payload_checksum)
    return verify_part(got, key, fingerprint, index, first)


def decode(
    key: bytes,
    fingerprint: bytes,
    read: ReadPart,
    out: memoryview | None = None,
    observe: CodecObserver | None = None,
) -> memoryview | None:
    """Read, verify and reassemble the value stored under ``key``.

    Returns None when fragment 0 is missing (a plain miss); raises
    `CorruptObject` when anything present is wrong or a later fragment is gone.
    A single uncompressed part is returned as a view of what ``read`` gave,
    with no copy; otherwise the value is assembled into ``out`` when it is given
    and large enough, else into a new buffer. ``observe`` hears the decompression
    (see `CodecObserver`).
    """
    assert len(key) == KEY_BYTES
    first_data = read(ChunkKey(bytes(key)))
    if first_data is None:
        return None
    first, payload = _verify_read(first_data, key, fingerprint, 0)
    if first.fragment_count == 1:
        if first.stored_length != payload.nbytes:
            raise CorruptObject("stored length disagrees with the payload")
        return _decompress(first.codec, payload, first.raw_length, observe)
    assembled = bytearray(first.stored_length)
    offset = 0
    for index in range(first.fragment_count):
        if index:
            data = read(fragment_key(key, index))
            if data is None:
                raise CorruptObject(f"fragment {index} of {first.fragment_count} is missing")
            _, payload = _verify_read(data, key, fingerprint, index, first)
        end = offset + payload.nbytes
        if end > first.stored_length:
            raise CorruptObject("fragments hold more bytes than the stored length")
        assembled[offset:end] = payload
        offset = end
    if offset != first.stored_length:
        raise CorruptObject(f"fragments hold {offset} bytes, header says {first.stored_length}")
    value = _decompress(first.codec, memoryview(assembled), first.raw_length, observe)
    if out is not None and out.nbytes >= value.nbytes:
        out[: value.nbytes] = value
        return out[: value.nbytes]
    return value
