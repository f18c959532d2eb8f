"""Large objects in chunks, so the CPU's work on one chunk overlaps the device's on another.

A put must copy the value into an aligned buffer (O_DIRECT needs one; the
caller's bytes are not) and checksum it; a get must checksum what it read and
copy it out. Done one after the other, that CPU time adds to the device's and a
32 MiB value is stored at well under the disk's speed. Here an I/O thread
writes (or reads) chunk k while the caller's thread copies and hashes chunk
k + 1: ``pwritev``/``preadv`` and xxh3 both let go of the GIL.

Contracts: every chunk's I/O has finished when a function returns or raises,
so the caller may reuse its buffer at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from kvharbor.hal.block.direct import pwrite_full
from kvharbor.hal.block.layout import BLOCK_BYTES
from kvharbor.hal.posix import read_into

CHUNK_BYTES = 4 * 1024 * 1024
"""Unit of overlap: large enough that a chunk's I/O costs far more than its submission,
small enough that the first chunk's copy (not overlapped) is a small part of a value."""


READ_AHEAD_CHUNKS = 3
"""Chunk reads in flight at once: one request at a time would leave the device's queue
(and its parallel flash channels) idle between chunks, where one whole-value read keeps it busy."""


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
    head_bytes: int,
    value_at: int,
    parts: Sequence[memoryview],
    end: int,
    seed: int,
) -> tuple[memoryview, int]:
    """Copy ``parts`` into ``staging`` from ``value_at`` and write ``staging[head_bytes:end]``
    to ``offset + head_bytes`` chunk by chunk as it fills. Returns the head,
    ``staging[:head_bytes]``, for the caller to complete (it holds the object header, which
    needs the checksum) and write last, and the value's xxh3 with ``seed``."""
    assert head_bytes % BLOCK_BYTES == 0 and end % BLOCK_BYTES == 0 and value_at <= head_bytes <= end
    hasher = xxhash.xxh3_64(seed=seed)
    futures: list[Future[None]] = []
    submitted = head_bytes
    filled = value_at
    try:
        for part in parts:
            for lo in range(0, part.nbytes, CHUNK_BYTES):
                piece = part[lo : lo + CHUNK_BYTES]
                target = staging[filled : filled + piece.nbytes]
                target[:] = piece
                hasher.update(target)
                filled += piece.nbytes
                ready = filled // BLOCK_BYTES * BLOCK_BYTES
                if ready - submitted >= CHUNK_BYTES:
                    futures.append(io.submit(pwrite_full, fd, staging[submitted:ready], offset + submitted))
                    submitted = ready
        if end > submitted:
            futures.append(io.submit(pwrite_full, fd, staging[submitted:end], offset + submitted))
    finally:
        _finish(futures)
    return staging[:head_bytes], hasher.intdigest()


def read_object(
    io: ThreadPoolExecutor,
    fd: int,
    into: memoryview,
    offset: int,
    value_at: int,
    value_bytes: int,
    seed: int,
    copy_to: memoryview | None,
) -> int | None:
    """Read ``into`` (whole blocks) from ``offset``, the next chunk while hashing (and copying
    to ``copy_to``) the value bytes ``into[value_at : value_at + value_bytes]`` of this one.
    Returns the value's xxh3 with ``seed``, or None when the device ended early."""
    chunks = [(lo, min(lo + CHUNK_BYTES, into.nbytes)) for lo in range(0, into.nbytes, CHUNK_BYTES)]
    hasher = xxhash.xxh3_64(seed=seed)
    value_end = value_at + value_bytes
    submitted: deque[Future[int]] = deque()

    def submit(i: int) -> None:
        if i < len(chunks):
            lo, hi = chunks[i]
            submitted.append(io.submit(read_into, fd, into[lo:hi], offset + lo))

    for i in range(READ_AHEAD_CHUNKS):
        submit(i)
    short = False
    try:
        for i, (lo, hi) in enumerate(chunks):
            if submitted.popleft().result() != hi - lo:
                short = True
                break
            submit(i + READ_AHEAD_CHUNKS)
            a, b = max(lo, value_at), min(hi, value_end)
            if b > a:
                hasher.update(into[a:b])
                if copy_to is not None:
                    copy_to[a - value_at : b - value_at] = into[a:b]
    finally:
        _finish(list(submitted))  # Chunks in flight finish before ``into`` is reused.
    return None if short else hasher.intdigest()
