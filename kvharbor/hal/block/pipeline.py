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
does not, which is why the chunks are hashed by a streaming hasher). A copy
between memoryviews holds it: a put's copy into staging is one chunk at a time,
and a get's copy out is done by the I/O thread that read the chunk, through
``ctypes.memmove``, which lets it go (`copy_released`), beside the caller's
thread hashing the chunk before.

What is not overlapped is the first chunk's copy on a write (no I/O can start
before it) and the last chunk's hash on a read (no I/O is left to overlap).
`chunk_plan` therefore starts and ends with small chunks, `FIRST_CHUNK_BYTES`,
doubling up to `CHUNK_BYTES` in between: the work on the critical path is a
fraction of a millisecond, while the middle of the value goes in chunks large
enough that a chunk's submission costs little against its I/O. A get queues
all its chunks at once (the pool's threads bound how many are in flight): the
device may serve them out of order, and reads queued only as earlier chunks are
hashed would wait behind the one it serves last.

Contracts: every chunk's I/O has finished when a function returns or raises,
so the caller may reuse its buffer at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from kvharbor.hal.block.direct import address, copy_released, pwrite_full
from kvharbor.hal.block.layout import BLOCK_BYTES, OBJECT_HEADER_BYTES, ValueLayout, round_up
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
) -> tuple[memoryview, int]:
    """Write the object of ``layout`` holding ``parts`` whose first byte is ``staging[start]``
    (``staging[0]`` goes to ``offset``), chunk by chunk as the copies into ``staging`` fill,
    all but its head: the blocks up to the value's body (split) or up to the end of the first
    block (contiguous). Returns the head, for the caller to complete (it holds the object
    header, which needs the value's checksum) and write last, and the value's xxh3 with ``seed``.

    A split value's body (its last part) is written from the caller's memory where it is
    whole blocks, and hashed while it is written; only its last partial block is copied."""
    hasher = xxhash.xxh3_64(seed=seed)
    futures: list[Future[None]] = []
    value_at = start + OBJECT_HEADER_BYTES

    def fill(lo: int, hi: int, source: _Gather, value_end: int, write: bool) -> None:
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
            fill(value_at, head_end, source, value_end, write=False)
            fill(head_end, start + layout.span, source, value_end, write=True)
        else:
            *prefix, body = parts
            head_end = start + layout.body_at
            fill(value_at, head_end, _Gather(prefix), value_at + layout.head_bytes, write=False)
            whole = body.nbytes // BLOCK_BYTES * BLOCK_BYTES
            for a, b in chunk_plan(0, whole):
                futures.append(io.submit(pwrite_full, fd, body[a:b], offset + head_end + a))
                hasher.update(body[a:b])
            tail_at = head_end + whole
            fill(tail_at, start + layout.span, _Gather([body[whole:]]), tail_at + body.nbytes - whole, write=True)
    finally:
        _finish(futures)
    return staging[:head_end], hasher.intdigest()


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
    ranges: Sequence[tuple[int, int]],
    seed: int,
    copy_to: memoryview | None,
    memory_align_bytes: int = BLOCK_BYTES,
) -> int | None:
    """Read the object of ``into.nbytes`` (whole blocks) at ``offset``, the next chunks while
    hashing (and, with ``copy_to``, handing out) the value's ``ranges`` of it in this one.
    Returns the value's xxh3 with ``seed``, or None when the device ended early.

    Where ``copy_to`` lies so that most of the value's blocks land at addresses aligned as the
    fd's I/O needs (``memory_align_bytes``, `Opened.memory_align_bytes`), those blocks are read
    straight into it and hashed there; the rest (the object header's block, a partial last
    block) is read into ``into`` and copied out. Either way the bytes in ``copy_to`` are the
    caller's only once the returned checksum matched."""
    if copy_to is not None and copy_to.nbytes < sum(b - a for a, b in ranges):
        raise ValueError(f"a value of {sum(b - a for a, b in ranges)} bytes does not fit {copy_to.nbytes}")
    hasher = xxhash.xxh3_64(seed=seed)
    placed = _placed(ranges)
    direct = None if copy_to is None else in_place_run(ranges, copy_to, memory_align_bytes)
    if direct is None:
        chunks = chunk_plan(0, into.nbytes)
    else:
        lo, hi, _ = direct
        chunks = [*chunk_plan(0, lo), *chunk_plan(lo, hi), *chunk_plan(hi, into.nbytes)]

    def landing(lo: int, hi: int) -> tuple[memoryview, int]:
        """Where the chunk ``[lo, hi)`` of the object is read to: the view and the shift from
        object offsets to its indices."""
        if direct is not None and copy_to is not None and direct[0] <= lo and hi <= direct[1]:
            return copy_to, direct[2]
        return into, 0

    def read_chunk(lo: int, hi: int) -> int:
        """Read one chunk and copy its value bytes out (unless it was read in place), in an I/O
        thread: the copy (GIL let go) runs beside the caller's hashing of the chunk before."""
        view, shift = landing(lo, hi)
        got = read_into(fd, view[lo + shift : hi + shift], offset + lo)
        if copy_to is not None and view is into and got == hi - lo:
            for (r0, r1), at in placed:
                a, b = max(lo, r0), min(hi, r1)
                if b > a:
                    copy_released(copy_to, at + a - r0, into, a, b)
        return got

    # Every chunk is queued at once; the pool's threads take them in order, as many at a time
    # as it has. A window refilled only as the chunks are hashed, in order, would stall
    # behind the one chunk the device serves late (it reorders requests; one 512 KiB
    # read was seen finishing after the next 16 MiB): every later chunk would wait with it.
    futures = [io.submit(read_chunk, lo, hi) for lo, hi in chunks]
    try:
        for (lo, hi), future in zip(chunks, futures, strict=True):
            if future.result() != hi - lo:
                return None
            view, shift = landing(lo, hi)
            for (r0, r1), _ in placed:
                a, b = max(lo, r0), min(hi, r1)
                if b > a:
                    hasher.update(view[a + shift : b + shift])
    finally:
        _finish(futures)  # Every chunk finishes before ``into`` (or ``copy_to``) is reused.
    return hasher.intdigest()
