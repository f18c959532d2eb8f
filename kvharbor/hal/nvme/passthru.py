"""The kernel's NVMe passthrough: ``struct nvme_passthru_cmd64`` and ``NVME_IOCTL_IO64_CMD``.

The layout is that of ``include/uapi/linux/nvme_ioctl.h`` (80 bytes, natural
alignment, no padding but the explicit ``rsvd`` fields). The ioctl hands the
struct to the controller and returns the completion's status field (phase bit
dropped: SCT bits 10:8, SC bits 7:0, CRD/More/DNR above), 0 on success, or
fails with an ``OSError`` for a host-side error; the completion's DW0 comes
back in ``result``.

Everything above the ioctl goes through `IoctlFn`, one small function, so that
tests drive the whole driver against a stand-in of the controller.
"""

from __future__ import annotations

import ctypes
import fcntl
from collections.abc import Callable
from typing import TypeAlias

_IOC_WRITE = 1
_IOC_READ = 2


def _iowr(kind: str, number: int, size: int) -> int:
    """Linux's ``_IOWR(kind, number, size)`` (asm-generic/ioctl.h: dir 2 bits, size 14, type 8, nr 8)."""
    return ((_IOC_READ | _IOC_WRITE) << 30) | (size << 16) | (ord(kind) << 8) | number


class PassthruCmd64(ctypes.Structure):
    """``struct nvme_passthru_cmd64``; field order and widths are the kernel's."""

    # fmt: off
    _fields_ = [
        ("opcode",       ctypes.c_uint8),
        ("flags",        ctypes.c_uint8),
        ("rsvd1",        ctypes.c_uint16),
        ("nsid",         ctypes.c_uint32),
        ("cdw2",         ctypes.c_uint32),
        ("cdw3",         ctypes.c_uint32),
        ("metadata",     ctypes.c_uint64),
        ("addr",         ctypes.c_uint64),
        ("metadata_len", ctypes.c_uint32),
        ("data_len",     ctypes.c_uint32),
        ("cdw10",        ctypes.c_uint32),
        ("cdw11",        ctypes.c_uint32),
        ("cdw12",        ctypes.c_uint32),
        ("cdw13",        ctypes.c_uint32),
        ("cdw14",        ctypes.c_uint32),
        ("cdw15",        ctypes.c_uint32),
        ("timeout_ms",   ctypes.c_uint32),
        ("rsvd2",        ctypes.c_uint32),
        ("result",       ctypes.c_uint64),
    ]
    # fmt: on


PASSTHRU_CMD64_BYTES = 80
if ctypes.sizeof(PassthruCmd64) != PASSTHRU_CMD64_BYTES:  # A real check: a wrong layout corrupts commands.
    raise ImportError(f"struct nvme_passthru_cmd64 is {ctypes.sizeof(PassthruCmd64)} bytes, not 80")

NVME_IOCTL_IO64_CMD = _iowr("N", 0x48, PASSTHRU_CMD64_BYTES)
NVME_IOCTL_ADMIN64_CMD = _iowr("N", 0x47, PASSTHRU_CMD64_BYTES)

IoctlFn: TypeAlias = Callable[[int, int, PassthruCmd64], int]
"""``(fd, request, cmd) -> int``: ``ioctl(fd, request, &cmd)``.

For the passthrough requests it submits ``cmd``, waits for its completion,
returns the completion's status field (0: success) and sets ``cmd.result`` to
DW0; the buffer at ``cmd.addr`` is read (host to device) or written (device to
host) according to the opcode's data direction. ``NVME_IOCTL_ID`` ignores
``cmd`` and returns the namespace id. Raises ``OSError`` when the host could not
deliver the command (EINTR, ENOTTY for a file that is not an NVMe device,
ENODEV for a vanished path)."""


def kernel_ioctl(fd: int, request: int, cmd: PassthruCmd64) -> int:
    """The real `IoctlFn`: ``ioctl(fd, request, &cmd)``; the kernel updates ``cmd`` in place."""
    return fcntl.ioctl(fd, request, cmd, True)
