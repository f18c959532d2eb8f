"""kvharbor's checksum of bytes: xxh3-64 of the xxh3-64 digests of their 1 MiB segments.

It is a cached object's payload checksum (object format 3, `kvharbor.cache.keys.FORMAT_VERSION`,
`kvharbor.cache.format`) and the checksum of a block-store object's body (block format 2,
`kvharbor.hal.block.layout.value_checksum`), so a payload's writer takes it once and every
layer below stores it as it is. Definition, with S = `SEGMENT_BYTES`::

    d_i = xxh3_64(data[i*S : (i+1)*S])          for i in 0 .. ceil(len(data) / S) - 1
    checksum(data) = xxh3_64(le_u64(d_0) || le_u64(d_1) || ...)

An empty value has no segments: its checksum is xxh3-64 of no bytes.

Why segments, and not one xxh3 over the value (format 2): one xxh3 is a serial pass, so a
reader hashes the whole value in one thread, beside or after its copy; on two cores a file
tier's warm get then ran at ~0.7x of a bare ``read``. Segment digests can be taken by
whichever thread holds a segment, in any order, while the segment is still in that core's
cache: a file tier's I/O threads hash the pieces they have just read
(`kvharbor.hal.file_reads`), the block store's those of its chunks
(`kvharbor.hal.block.pipeline`); a writer hashes each slice it has just copied
(`copy_with_checksum`). Combining costs one hash of 8 bytes per MiB. What it guards against
is unchanged: damage (torn writes, bit rot, truncation, a segment moved), not an adversary.

xxhash's streaming ``update`` lets go of the GIL while it hashes; its one-shot
``xxh3_64_intdigest`` does not. Segments are therefore hashed through a streaming hasher, so
that hashing threads run side by side.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from kvharbor.hal.base import Buffer

SEGMENT_BYTES = 1 << 20
"""A checksum segment: large enough that its digest's 8 bytes and the per-segment call cost
nothing beside its hash (~60 µs at 17 GB/s), small enough to be hashed while still in a
server core's L2 cache (1-2 MiB) right after it was copied or read."""

COPY_SLICE_BYTES = SEGMENT_BYTES
"""Slice of `copy_with_checksum`: one segment, hashed right after its copy while it is still
in the CPU cache."""


def _bytes(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def segment_digest(data: Buffer) -> int:
    """xxh3-64 of one segment, hashed without holding the GIL."""
    hasher = xxhash.xxh3_64()
    hasher.update(data)
    return hasher.intdigest()


def combine(digests: Sequence[int]) -> int:
    """The checksum of a value from its segments' digests, in the value's order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def checksum(data: Buffer) -> int:
    """The payload checksum of ``data`` (see the module docstring)."""
    view = _bytes(data)
    segments = range(0, view.nbytes, SEGMENT_BYTES)
    return combine([segment_digest(view[start : start + SEGMENT_BYTES]) for start in segments])


class ChecksumStream:
    """`checksum` of bytes fed in order, in slices of any length (`update`); `intdigest`
    gives the checksum of all bytes fed so far."""

    __slots__ = ("_digests", "_filled", "_hasher")

    def __init__(self) -> None:
        self._digests: list[int] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0
        """Bytes of the current segment hashed so far."""

    def update(self, data: Buffer) -> None:
        view = _bytes(data)
        while view.nbytes:
            taken = min(SEGMENT_BYTES - self._filled, view.nbytes)
            self._hasher.update(view[:taken])
            self._filled += taken
            view = view[taken:]
            if self._filled == SEGMENT_BYTES:
                self._digests.append(self._hasher.intdigest())
                self._hasher.reset()
                self._filled = 0

    def intdigest(self) -> int:
        tail = [self._hasher.intdigest()] if self._filled else []
        return combine([*self._digests, *tail])


def copy_with_checksum(source: Buffer, into: memoryview) -> int:
    """Copy ``source`` into ``into`` and return its `checksum`, hashing each segment just
    copied while it is still in the CPU cache: one pass over memory, not two."""
    data = _bytes(source)
    if into.nbytes != data.nbytes:
        raise ValueError(f"copy_with_checksum: {data.nbytes} bytes into {into.nbytes}")
    digests = []
    for start in range(0, data.nbytes, COPY_SLICE_BYTES):
        target = into[start : start + COPY_SLICE_BYTES]
        target[:] = data[start : start + COPY_SLICE_BYTES]
        digests.append(segment_digest(target))
    return combine(digests)
