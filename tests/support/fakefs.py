"""pyfakefs for the file tier's fault tests: the vectored calls it makes, and read-only mounts.

pyfakefs fakes ``os.write``, ``os.read`` and ``os.lseek`` but not ``os.writev``,
``os.preadv`` and ``os.posix_fadvise``, which would reach the real kernel with a fake
descriptor (EBADF, or whatever real file has that number: a test worker's pipe answers
ESPIPE); these are written here in terms of the fake's own calls, so that every byte the
file tier moves goes through the fake filesystem, with its permissions, its mount
points' sizes (ENOSPC) and its errors. pyfakefs has no read-only mounts either:
`FakeDisk.mount_read_only` makes every call that would change a tree answer EROFS,
as the kernel does for a filesystem mounted (or remounted) ``ro``.

The fake user is not root (``allow_root_user=False``), so permissions are enforced
even where the tests run as root.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pyfakefs.fake_filesystem import FakeFilesystem
from pyfakefs.fake_filesystem_unittest import Patcher

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGING_CALLS = ("mkdir", "makedirs", "rename", "replace", "unlink", "remove", "rmdir")


class FakeDisk:
    """The fake filesystem, and the mounts of it made read-only."""

    def __init__(self, fs: FakeFilesystem) -> None:
        self.fs = fs
        self.read_only: set[str] = set()

    def mount_read_only(self, path: str) -> None:
        """From now on ``path`` and everything under it refuse changes with EROFS."""
        self.read_only.add(os.path.normpath(path))

    def check_writable(self, *paths: Any) -> None:
        for path in paths:
            if isinstance(path, (str, os.PathLike)):
                normal = os.path.normpath(os.fspath(path))
                if any(normal == ro or normal.startswith(ro + os.sep) for ro in self.read_only):
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), normal)


@contextmanager
def fake_disk() -> Iterator[FakeDisk]:
    """A fake filesystem in place of the real one for the block's duration."""
    with Patcher(allow_root_user=False) as patcher:
        assert patcher.fs is not None
        disk = FakeDisk(patcher.fs)
        fake_os = patcher.fake_modules["os"]

        def writev(fd: int, buffers: Sequence[Any]) -> int:
            written = 0
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                n = fake_os.write(fd, bytes(view))
                written += n
                if n < view.nbytes:
                    break  # A short write, as the kernel may make one.
            return written

        def preadv(fd: int, buffers: Sequence[Any], offset: int) -> int:
            fake_os.lseek(fd, offset, os.SEEK_SET)
            got = 0
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                data = fake_os.read(fd, view.nbytes)
                view[: len(data)] = data
                got += len(data)
                if len(data) < view.nbytes:
                    break
            return got

        def posix_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
            disk.fs.get_open_file(fd)  # EBADF for a descriptor the fake did not open; advice changes no byte.

        def refusing(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
            def checked(*args: Any, **kwargs: Any) -> Any:
                # As the kernel: making a directory that exists is EEXIST, read-only or not.
                if not (name in ("mkdir", "makedirs") and fake_os.path.isdir(args[0])):
                    disk.check_writable(*args[:2])
                return call(*args, **kwargs)

            return checked

        real_open = fake_os.open

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & _WRITE_FLAGS:
                disk.check_writable(path)
            return real_open(path, flags, *args, **kwargs)

        fake_os.writev = writev
        fake_os.preadv = preadv
        fake_os.posix_fadvise = posix_fadvise
        fake_os.open = open_
        for name in _CHANGING_CALLS:
            setattr(fake_os, name, refusing(name, getattr(fake_os, name)))
        yield disk
