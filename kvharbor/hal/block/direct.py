"""Aligned buffers and O_DIRECT I/O for the block store.

O_DIRECT moves data between the device and the caller's buffer without the page
cache, so the buffer's address, the length and the file offset must all be
multiples of the device's logical block; an anonymous ``mmap`` is page-aligned
(4096), which every device here accepts. Some filesystems (tmpfs, some FUSE
mounts) refuse O_DIRECT; the store then uses buffered I/O with ``fdatasync`` —
as durable, only slower and through the page cache — and says so once.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass

from kvharbor.hal.block.layout import BLOCK_BYTES, round_up

_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC
# statx(2), from include/uapi/linux/stat.h and fcntl.h: the mask bit asking for the O_DIRECT
# alignments, a path of "" meaning the fd itself, and where they sit in the 256-byte struct statx.
_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_BYTES = 256
_U32 = struct.Struct("<I")
_STATX_MASK_AT = 0
_STATX_DIO_MEM_ALIGN_AT = 152


class AlignedBuffer:
    """``nbytes`` (whole blocks) of anonymous memory at a page-aligned address."""

    def __init__(self, nbytes: int) -> None:
        assert nbytes > 0 and nbytes % BLOCK_BYTES == 0, nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.nbytes = nbytes

    def close(self) -> None:
        self.view.release()
        self._map.close()


class BufferPool:
    """Reusable aligned buffers of one size: a fresh 32 MiB mapping costs ~8 k page faults
    per read, a pooled one none. Buffers are made on demand, one per concurrent user."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()

    def take(self) -> AlignedBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        return AlignedBuffer(self.nbytes)

    def give(self, buffer: AlignedBuffer) -> None:
        with self._lock:
            self._free.append(buffer)

    def close(self) -> None:
        with self._lock:
            for buffer in self._free:
                buffer.close()
            self._free.clear()


@dataclass(frozen=True, slots=True)
class Opened:
    fd: int
    direct: bool
    """False where the filesystem refused O_DIRECT (buffered I/O and fdatasync instead)."""
    size_bytes: int
    block_device: bool
    memory_align_bytes: int = BLOCK_BYTES
    """The alignment I/O needs of a buffer's address on ``fd``: O_DIRECT's as the kernel states it
    (`dio_memory_alignment`), 1 for buffered I/O (the kernel copies through the page cache)."""


def open_direct(path: str) -> Opened:
    """Open ``path`` read-write, with O_DIRECT where the filesystem takes it.

    A filesystem may refuse O_DIRECT at open (tmpfs: EINVAL) or accept the flag
    and refuse the first aligned read; both fall back to buffered I/O. Raises
    OSError for anything else (absent, no permission).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS | os.O_DIRECT)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    else:
        try:
            size_bytes, block_device = _size(fd)
            if _direct_read_works(fd):
                return Opened(fd, True, size_bytes, block_device, dio_memory_alignment(fd))
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    fd = os.open(path, _OPEN_FLAGS)
    size_bytes, block_device = _size(fd)
    return Opened(fd, False, size_bytes, block_device, 1)


def dio_memory_alignment(fd: int) -> int:
    """The alignment O_DIRECT needs of a buffer's address on ``fd``, as ``statx`` states it
    (``STATX_DIOALIGN``: Linux 6.1 for files, 6.11 for block devices; 512 on a virtio disk, 4 on
    NVMe). `BLOCK_BYTES`, which every device here takes, where the kernel or libc does not say or
    says something that does not divide it."""
    libc = ctypes.CDLL(None, use_errno=True)
    statx = getattr(libc, "statx", None)  # glibc >= 2.28
    if statx is None:
        return BLOCK_BYTES
    out = ctypes.create_string_buffer(_STATX_BYTES)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, out) != 0:
        return BLOCK_BYTES
    (mask,) = _U32.unpack_from(out, _STATX_MASK_AT)
    (align,) = _U32.unpack_from(out, _STATX_DIO_MEM_ALIGN_AT)
    if not mask & _STATX_DIOALIGN or align <= 0 or BLOCK_BYTES % align:
        return BLOCK_BYTES
    return int(align)


def _size(fd: int) -> tuple[int, bool]:
    """Size in bytes (a block device's from seeking to its end) and whether it is one."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISBLK(mode):
        return os.lseek(fd, 0, os.SEEK_END), True
    return os.fstat(fd).st_size, False


def _direct_read_works(fd: int) -> bool:
    buffer = AlignedBuffer(BLOCK_BYTES)
    try:
        os.preadv(fd, [buffer.view], 0)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    finally:
        buffer.close()
    return True


def address(view: memoryview) -> int:
    """Where a writable contiguous ``view`` starts in memory (ctypes takes writable buffers only)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def block_aligned(view: memoryview) -> bool:
    """Whether ``view`` (contiguous bytes) starts on a block edge in memory, so that O_DIRECT can
    write from it where it is. A read-only view counts as unaligned: its address cannot be
    taken (and a ``bytes`` object's data is never page-aligned anyway)."""
    return not view.readonly and address(view) % BLOCK_BYTES == 0


def copy_released(into: memoryview, at: int, source: memoryview, lo: int, hi: int) -> None:
    """``into[at : at + hi - lo] = source[lo:hi]`` without the GIL: ctypes lets it go for the
    call, where a memoryview copy holds it, so that an I/O thread copies while the caller's
    thread hashes. Both views writable and contiguous; bounds are checked here, as memmove
    checks none."""
    if not (0 <= lo <= hi <= source.nbytes and at >= 0 and at + hi - lo <= into.nbytes):
        raise ValueError(f"copy of [{lo}, {hi}) of {source.nbytes} bytes to {at} of {into.nbytes} is out of bounds")
    ctypes.memmove(address(into) + at, address(source) + lo, hi - lo)


def pwrite_full(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` (whole blocks, aligned for O_DIRECT) at ``offset``."""
    assert data.nbytes == round_up(data.nbytes), data.nbytes
    done = 0
    while done < data.nbytes:
        n = os.pwritev(fd, [data[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev made no progress")
        done += n
