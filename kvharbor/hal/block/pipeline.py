"""Large objects in chunks, so the CPU's work on one chunk overlaps the device's on another.

A put must checksum the value and, for O_DIRECT, write it from aligned memory:
where the value's last part is block-aligned in the caller's memory (a payload
in shared memory) it is written from there, in place, and hashed while it is
written (`ValueLayout`'s split); otherwise it is copied into the store's aligned
staging buffer chunk by chunk, each chunk written as soon as it is filled. A get
must checksum what it read and hand it out: where the caller's buffer puts the
value's blocks at addresses O_DIRECT can read into (`in_place_run`: a payload on
a page edge after its header, as a put takes it) they are read there, in place;
otherwise, and for the object header's block and a partial last block, into the
store's buffer and copied out. Done one after the other, that CPU
time adds to the device's and a 32 MiB value is stored at well under the disk's
speed; here I/O threads write (or read) chunk k while the caller's thread copies
and hashes chunk k + 1.

That overlaps only because neither side holds the GIL for long: ``pwritev`` and
``preadv`` let it go, and so does xxhash's streaming ``xxh3_64.update`` (its C
code runs inside ``Py_BEGIN_ALLOW_THREADS``; the one-shot ``xxh3_64_intdigest``
does not). A copy between memoryviews holds it: a put's copy into staging is one
chunk at a time, and a get's copy out is done by the I/O thread that read the
chunk, through ``ctypes.memmove``, which lets it go (`copy_released`).

The value checksum covers the value's head and body apart
(`kvharbor.hal.block.layout.value_checksum`), the body in 1 MiB segments. A get
hashes each segment in the I/O thread that lands its last byte, in whatever
order the device serves the chunks (`_Segments`), so the hash runs on as many
cores as there are reads in flight instead of in one thread, in chunk order,
behind them. A put whose caller took the body's checksum already (a payload in
shared memory, `write_object`'s ``body_checksum``) does not hash it at all;
otherwise the caller's thread hashes each chunk while the one before is written.

What is not overlapped is the first chunk's copy on a write (no I/O can start
before it) and the last segment's hash on a read (no I/O is left to overlap).
`chunk_plan` therefore starts and ends with small chunks, `FIRST_CHUNK_BYTES`,
doubling up to `CHUNK_BYTES` in between: the work on the critical path is a
fraction of a millisecond, while the middle of the value goes in chunks large
enough that a chunk's submission costs little against its I/O. A get queues
all its chunks at once (the pool's threads bound how many are in flight): the
device may serve them out of order.

Contracts: every chunk's I/O has finished when a function returns or raises,
so the caller may reuse its buffer at once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from kvharbor.hal.block.direct import address, copy_released, pwrite_full
from kvharbor.hal.block.layout import (
    BLOCK_BYTES,
    OBJECT_HEADER_BYTES,
    ValueLayout,
    checksum,
    round_up,
    value_checksum,
)
from kvharbor.hal.checksum import SEGMENT_BYTES, ChecksumStream, combine, segment_digest
from kvharbor.hal.posix import read_into

CHUNK_BYTES = 4 * 1024 * 1024
"""Largest chunk: the device's unit of work in the middle of a value (the kernel splits a
larger O_DIRECT request at ``max_sectors_kb``, 4 MiB here, anyway)."""
FIRST_CHUNK_BYTES = 256 * 1024
"""First and last chunk: the copy (on a put) or hash and copy (on a get) of this many bytes is
the CPU work that cannot overlap any I/O, ~40 µs at memory speed."""


def chunk_plan(lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` (block-aligned) cut into chunks: from `FIRST_CHUNK_BYTES` doubling up to
    `CHUNK_BYTES` at the start, the same sizes shrinking at the end, `CHUNK_BYTES` between."""
    assert lo % BLOCK_BYTES == 0 and hi % BLOCK_BYTES == 0 and lo <= hi, (lo, hi)
    front: list[int] = []
    back: list[int] = []
    rest = hi - lo
    size = FIRST_CHUNK_BYTES
    while size < CHUNK_BYTES and rest > 2 * size:
        front.append(size)
        back.append(size)
        rest -= 2 * size
        size *= 2
    middle = [CHUNK_BYTES] * (rest // CHUNK_BYTES)
    if rest % CHUNK_BYTES:
        middle.append(rest % CHUNK_BYTES)  # Whole blocks: ``rest`` and every size above are.
    bounds = []
    for nbytes in [*front, *middle, *reversed(back)]:
        bounds.append((lo, lo + nbytes))
        lo += nbytes
    return bounds


class _Gather:
    """The concatenation of ``parts``, handed out piece by piece without joining them."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._parts: Iterator[memoryview] = iter(parts)
        self._current = memoryview(b"")

    def copy_into(self, target: memoryview) -> None:
        """Fill ``target`` with the next ``target.nbytes`` bytes of the parts."""
        done = 0
        while done < target.nbytes:
            while not self._current.nbytes:
                self._current = next(self._parts)  # The caller never asks past the value's end.
            n = min(self._current.nbytes, target.nbytes - done)
            target[done : done + n] = self._current[:n]
            self._current = self._current[n:]
            done += n


def _finish(futures: Sequence[Future[Any]]) -> None:
    """Wait for every chunk, then raise the first error: none is left writing into a buffer."""
    errors = [err for err in (f.exception() for f in futures) if err is not None]
    if errors:
        raise errors[0]


def write_object(
    io: ThreadPoolExecutor,
    fd: int,
    staging: memoryview,
    offset: int,
    start: int,
    layout: ValueLayout,
    parts: Sequence[memoryview],
    seed: int,
    body_checksum: int | None = None,
) -> tuple[memoryview, int]:
    """Write the object of ``layout`` holding ``parts`` whose first byte is ``staging[start]``
    (``staging[0]`` goes to ``offset``), chunk by chunk as the copies into ``staging`` fill,
    all but its head: the blocks up to the value's body (split) or up to the end of the first
    block (contiguous). Returns the head, for the caller to complete (it holds the object
    header, which needs the value's checksum) and write last, and the value's checksum
    (`value_checksum` with ``seed``).

    A split value's body (its last part) is written from the caller's memory where it is
    whole blocks; only its last partial block is copied. ``body_checksum``, where the caller
    has it, is `kvharbor.hal.checksum.checksum` of the last part: a split value's body is then
    not hashed again (a wrong one makes the object fail its checksum on every read: a miss,
    never wrong bytes). A contiguous value is hashed whole as it is copied."""
    head_hash = xxhash.xxh3_64(seed=seed)
    body_hash = ChecksumStream()
    futures: list[Future[None]] = []
    value_at = start + OBJECT_HEADER_BYTES

    def fill(
        lo: int, hi: int, source: _Gather, value_end: int, hasher: xxhash.xxh3_64 | ChecksumStream, write: bool
    ) -> None:
        """``staging[lo:hi]`` filled from ``source`` up to ``value_end`` (padding after), hashed
        and, with ``write``, written chunk by chunk."""
        for a, b in chunk_plan(lo, hi) if write else [(lo, hi)]:
            value = staging[a : max(a, min(b, value_end))]
            source.copy_into(value)
            hasher.update(value)
            if write:
                futures.append(io.submit(pwrite_full, fd, staging[a:b], offset + a))

    try:
        if not layout.body_at:
            head_end = start + BLOCK_BYTES
            source = _Gather(parts)
            value_end = value_at + layout.value_bytes
            fill(value_at, head_end, source, value_end, body_hash, write=False)
            fill(head_end, start + layout.span, source, value_end, body_hash, write=True)
            body_checksum = None
        else:
            *prefix, body = parts
            head_end = start + layout.body_at
            fill(value_at, head_end, _Gather(prefix), value_at + layout.head_bytes, head_hash, write=False)
            whole = body.nbytes // BLOCK_BYTES * BLOCK_BYTES
            for a, b in chunk_plan(0, whole):
                futures.append(io.submit(pwrite_full, fd, body[a:b], offset + head_end + a))
                if body_checksum is None:
                    body_hash.update(body[a:b])
            tail_at = head_end + whole
            tail_end = tail_at + body.nbytes - whole
            fill(tail_at, start + layout.span, _Gather([body[whole:]]), tail_end, body_hash, write=True)
    finally:
        _finish(futures)
    body_digest = body_hash.intdigest() if body_checksum is None else body_checksum
    return staging[:head_end], value_checksum(head_hash.intdigest(), body_digest, seed)


class _Segments:
    """The digests of a body's 1 MiB segments, each taken by the thread that lands the
    segment's last byte (`landed`), whatever the order the chunks land in."""

    def __init__(self, body: memoryview) -> None:
        self._body = body
        """Where the body's bytes end up (hashed there once a segment is whole)."""
        self._left = [min(SEGMENT_BYTES, body.nbytes - at) for at in range(0, body.nbytes, SEGMENT_BYTES)]
        """Bytes of each segment not landed yet."""
        self._digests = [0] * len(self._left)
        self._lock = threading.Lock()

    def landed(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of the body hold their final value (each byte is said once)."""
        whole = []
        with self._lock:
            for k in range(lo // SEGMENT_BYTES, -(-hi // SEGMENT_BYTES)):
                self._left[k] -= min(hi, (k + 1) * SEGMENT_BYTES) - max(lo, k * SEGMENT_BYTES)
                if self._left[k] < 0:
                    raise AssertionError(f"body bytes [{lo}, {hi}) landed twice (segment {k})")
                if self._left[k] == 0:
                    whole.append(k)
        for k in whole:
            self._digests[k] = segment_digest(self._body[k * SEGMENT_BYTES : (k + 1) * SEGMENT_BYTES])

    def digests(self) -> list[int]:
        """Each segment's `segment_digest`, in order; call once every byte landed."""
        if any(self._left):
            raise AssertionError(f"{sum(self._left)} body bytes never landed")
        return list(self._digests)


@dataclass(frozen=True, slots=True)
class ObjectRead:
    """What `read_object` hashed of the object it read."""

    checksum: int
    """The value's (`value_checksum`), to compare with its header's."""
    body_digests: list[int]
    """The body's 1 MiB segments' `segment_digest`, in order: a consumer that checksums the
    body in the same segments takes them instead of hashing the bytes again."""


def _placed(ranges: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """Each of a value's ranges in its object with where its bytes start in the value."""
    return list(zip(ranges, itertools.accumulate((b - a for a, b in ranges), initial=0), strict=False))


def in_place_run(
    ranges: Sequence[tuple[int, int]], copy_to: memoryview, memory_align_bytes: int
) -> tuple[int, int, int] | None:
    """The largest run of whole blocks ``[lo, hi)`` of an object, inside one of its value's
    ``ranges``, whose place in ``copy_to`` (object offset + ``shift``) starts at an address that
    O_DIRECT can read into, as ``(lo, hi, shift)``; None where there is none."""
    runs = [(round_up(r0), r1 // BLOCK_BYTES * BLOCK_BYTES, at - r0) for (r0, r1), at in _placed(ranges)]
    base = address(copy_to)
    aligned = [(lo, hi, shift) for lo, hi, shift in runs if hi > lo and (base + lo + shift) % memory_align_bytes == 0]
    return max(aligned, key=lambda run: run[1] - run[0], default=None)


def read_object(
    io: ThreadPoolExecutor,
    fd: int,
    into: memoryview,
    offset: int,
    layout: ValueLayout,
    seed: int,
    copy_to: memoryview | None,
    memory_align_bytes: int = BLOCK_BYTES,
) -> ObjectRead | None:
    """Read the object of ``layout`` (``into.nbytes``, whole blocks) at ``offset``, all its
    chunks queued at once, each hashed (and, with ``copy_to``, handed out) by the thread that
    read it. Returns what was hashed (the value's checksum is `value_checksum` with
    ``seed``), or None when the device ended early.

    Where ``copy_to`` lies so that most of the value's blocks land at addresses aligned as the
    fd's I/O needs (``memory_align_bytes``, `Opened.memory_align_bytes`), those blocks are read
    straight into it and hashed there; the rest (the object header's block, a partial last
    block) is read into ``into`` and copied out. Either way the bytes in ``copy_to`` are the
    caller's only once the returned checksum matched."""
    ranges = layout.ranges()
    if copy_to is not None and copy_to.nbytes < layout.value_bytes:
        raise ValueError(f"a value of {layout.value_bytes} bytes does not fit {copy_to.nbytes}")
    placed = _placed(ranges)
    (h0, h1), (b0, b1) = layout.halves
    if copy_to is None:
        head, body = into[h0:h1], into[b0:b1]
    else:
        head, body = copy_to[: layout.head_bytes], copy_to[layout.head_bytes : layout.value_bytes]
    segments = _Segments(body)
    direct = None if copy_to is None else in_place_run(ranges, copy_to, memory_align_bytes)
    if direct is None or copy_to is None:
        chunks = chunk_plan(0, into.nbytes)
        direct_lo = direct_hi = shift = 0
    else:
        direct_lo, direct_hi, shift = direct
        chunks = [*chunk_plan(0, direct_lo), *chunk_plan(direct_lo, direct_hi), *chunk_plan(direct_hi, into.nbytes)]

    def read_chunk(lo: int, hi: int) -> bool:
        """Read one chunk, copy its value bytes out (unless it was read in place) and hash
        the body's segments it completes, in an I/O thread; False if the device ended early."""
        if copy_to is not None and direct_lo <= lo and hi <= direct_hi:
            if read_into(fd, copy_to[lo + shift : hi + shift], offset + lo) != hi - lo:
                return False
        elif read_into(fd, into[lo:hi], offset + lo) != hi - lo:
            return False
        elif copy_to is not None:
            for (r0, r1), at in placed:
                a, b = max(lo, r0), min(hi, r1)
                if b > a:
                    copy_released(copy_to, at + a - r0, into, a, b)
        if max(lo, b0) < min(hi, b1):
            segments.landed(max(lo, b0) - b0, min(hi, b1) - b0)
        return True

    # Every chunk is queued at once; the pool's threads take them in order, as many at a time
    # as it has, and the device may serve them in another (one 512 KiB read was seen finishing
    # after the next 16 MiB): nothing waits for the chunks in order.
    futures = [io.submit(read_chunk, lo, hi) for lo, hi in chunks]
    _finish(futures)  # Every chunk finishes before ``into`` (or ``copy_to``) is reused.
    if not all(f.result() for f in futures):
        return None
    digests = segments.digests()
    return ObjectRead(value_checksum(checksum(head, seed), combine(digests), seed), digests)
