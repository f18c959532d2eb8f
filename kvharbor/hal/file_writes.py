"""Writing one new file from a value's parts, with O_DIRECT where the parts allow it.

A buffered write copies the value into the page cache, then the fsync writes it out: on
these VMs that copy runs at ~1 GB/s and slows down under load as any CPU work does, where an
O_DIRECT write lets the disk take the bytes from the writer's memory (bench/store.py:
``raw_write_direct``). O_DIRECT needs the buffer's address, the length and the file offset
on block edges. A stored object is a header a page long, then the payload
(`kvharbor.cache.format`), and the gateway's values lie page-aligned in shared memory: so the
header is copied into a page of aligned memory, the payload's whole blocks are written
straight from where they lie, and its last partial block is written buffered (O_DIRECT is
turned off on the descriptor for it, ``fcntl(F_SETFL)``). Parts that do not lie so are
written buffered, as a whole.

A filesystem that refuses O_DIRECT (EINVAL when the flag is set or at the first aligned
write) gets the whole file written buffered instead, from its first byte, and
`WriteResult.refused` tells the caller, who stops asking and says so once. The caller's
fsync makes either durable.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvharbor.hal.block.direct import block_aligned, pwrite_full
from kvharbor.hal.block.layout import BLOCK_BYTES
from kvharbor.hal.posix import write_all

DIRECT_HEAD_MAX_BYTES = 64 * 1024
"""Most bytes before the last part (the object header) that are copied into aligned memory
for an O_DIRECT write; parts longer than that are not a header, and are written buffered."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    nbytes: int
    direct: bool
    """O_DIRECT wrote the file's whole blocks."""
    refused: bool
    """The filesystem refused O_DIRECT: written buffered."""


def write_parts(fd: int, parts: Sequence[memoryview], direct: bool) -> WriteResult:
    """Write ``parts`` (byte views) at the start of the new, empty file ``fd``; with
    ``direct``, with O_DIRECT where they lie as the module docstring says. OSError as the
    writes raise it."""
    if not parts:
        return WriteResult(0, False, False)  # An empty value: the empty file is all of it.
    *head, body = parts
    head_bytes = sum(part.nbytes for part in head)
    whole = body.nbytes // BLOCK_BYTES * BLOCK_BYTES
    if not (
        direct and head_bytes % BLOCK_BYTES == 0 and head_bytes <= DIRECT_HEAD_MAX_BYTES and whole
    ) or not block_aligned(body):
        return WriteResult(write_all(fd, parts), False, False)
    try:
        _set_direct(fd, True)
        if head_bytes:
            _write_head(fd, head, head_bytes)
        pwrite_full(fd, body[:whole], head_bytes)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        _set_direct(fd, False)
        os.ftruncate(fd, 0)  # Whatever the direct writes left; the offset is still 0 (pwrite).
        return WriteResult(write_all(fd, parts), False, True)
    _set_direct(fd, False)
    os.lseek(fd, head_bytes + whole, os.SEEK_SET)
    tail = write_all(fd, [body[whole:]])
    return WriteResult(head_bytes + whole + tail, True, False)


def _write_head(fd: int, head: Sequence[memoryview], head_bytes: int) -> None:
    """The parts before the payload, copied into fresh page-aligned memory and written there
    (freed with its last view: a failed write's traceback may still hold one)."""
    staging = memoryview(mmap.mmap(-1, head_bytes))
    at = 0
    for part in head:
        staging[at : at + part.nbytes] = part
        at += part.nbytes
    pwrite_full(fd, staging, 0)


def _set_direct(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
