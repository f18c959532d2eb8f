"""pyfakefs with the vectored calls the file tier makes: ``os.writev`` and ``os.preadv``.

pyfakefs fakes ``os.write``, ``os.read`` and ``os.lseek`` but not the vectored
calls, which would reach the real kernel with a fake descriptor (EBADF). These
two are written in terms of the fake's own calls, so that every byte the file
tier moves goes through the fake filesystem, with its permissions, its mount
points' sizes (ENOSPC) and its errors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pyfakefs.fake_filesystem import FakeFilesystem
from pyfakefs.fake_filesystem_unittest import Patcher


@contextmanager
def fake_filesystem() -> Iterator[FakeFilesystem]:
    """A fake filesystem in place of the real one for the block's duration."""
    with Patcher() as patcher:
        fake_os = patcher.fake_modules["os"]
        assert patcher.fs is not None

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
            fake_os.lseek(fd, offset, 0)
            got = 0
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                data = fake_os.read(fd, view.nbytes)
                view[: len(data)] = data
                got += len(data)
                if len(data) < view.nbytes:
                    break
            return got

        fake_os.writev = writev
        fake_os.preadv = preadv
        yield patcher.fs
