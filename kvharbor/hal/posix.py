"""POSIX I/O for drivers that keep values in files: whole writes, whole reads, typed errors.

`os.writev` and `os.preadv` may move fewer bytes than asked (signals, network
filesystems, 2 GiB per call on Linux); these helpers loop until done, so a
driver never stores or returns a prefix by accident.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from kvharbor.hal.base import DeviceError, DeviceFull, DeviceTransient, DeviceUnavailable

IOV_MAX = os.sysconf("SC_IOV_MAX")
"""Most buffers one ``writev`` takes; above it Linux answers EINVAL."""

_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
# Worth retrying later: interrupted, busy or out of a per-process resource.
_TRANSIENT = frozenset({errno.EINTR, errno.EAGAIN, errno.ETIMEDOUT, errno.EBUSY, errno.EMFILE, errno.ENFILE})


def device_error(device: str, err: OSError, action: str) -> DeviceError:
    """The typed error for ``err``; ``action`` says what failed, for the log.

    Everything not full and not transient — EIO, ENOTCONN, ESTALE, EROFS,
    EACCES, a vanished directory — means the storage cannot serve: unavailable,
    so the tier's breaker stops sending it work.
    """
    message = f"{action}: {err.strerror or err}"
    if err.errno in _FULL:
        return DeviceFull(device, message)
    if err.errno in _TRANSIENT:
        return DeviceTransient(device, message)
    return DeviceUnavailable(device, message)


def write_all(fd: int, parts: Sequence[memoryview]) -> int:
    """Write every byte of ``parts`` at the file offset; returns the bytes written."""
    views = [part for part in parts if part.nbytes]
    total = sum(view.nbytes for view in views)
    written = 0
    first = 0  # Index of the first view not yet fully written.
    while first < len(views):
        n = os.writev(fd, views[first : first + IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, "writev made no progress")
        written += n
        assert written <= total, (written, total)  # Fail fast, not by filling the disk.
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    assert written == total, (written, total)
    return written


def read_into(fd: int, into: memoryview, offset: int = 0) -> int:
    """Read from ``offset`` until ``into`` is full or the file ends; returns the bytes read."""
    assert into.format == "B" and not into.readonly, (into.format, into.readonly)
    got = 0
    while got < into.nbytes:
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            break
        got += n
    assert 0 <= got <= into.nbytes
    return got


def fsync_dir(path: str) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def device_mode(where: str, path: str) -> int:
    """``st_mode`` of a configured device path; ValueError naming ``where`` (the tier and
    device) when it does not exist or cannot be inspected."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist") from None
    except OSError as err:
        raise ValueError(f"{where} cannot be inspected: {err.strerror}") from None
