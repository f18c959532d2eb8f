"""Space in the shared-memory segment: page-aligned extents handed out per transfer.

A transfer asks for room, the client (put) or the gateway (get) fills it, and
the other side reads it in place; then the extent is freed. When the ring is
full a request waits up to ``wait_ms`` and is then refused (backpressure): a
put is then skipped and a get is a miss, never a stalled engine.
"""

from __future__ import annotations

import bisect
import threading
import time

from kvharbor.gateway.shm import PAGE_BYTES


def round_up(nbytes: int) -> int:
    return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)


class Ring:
    """First-fit allocator over [0, size) with coalescing free extents."""

    def __init__(self, size: int) -> None:
        assert size > 0 and size % PAGE_BYTES == 0, size
        self.size = size
        self._starts: list[int] = [0]
        self._lengths: dict[int, int] = {0: size}
        self._used: dict[int, int] = {}
        self._free_bytes = size
        self._cond = threading.Condition()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def allocate(self, nbytes: int, wait_ms: int = 0) -> int | None:
        """Offset of ``nbytes`` (rounded up to pages), or None if no room came in time."""
        need = round_up(nbytes)
        if need > self.size:
            return None
        deadline = time.monotonic() + wait_ms / 1000
        with self._cond:
            while True:
                offset = self._take(need)
                if offset is not None:
                    return offset
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def free(self, offset: int) -> None:
        with self._cond:
            length = self._used.pop(offset)
            self._free_bytes += length
            self._insert(offset, length)
            self._check()
            self._cond.notify_all()

    def _take(self, need: int) -> int | None:
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < need:
                continue
            del self._lengths[start]
            if length == need:
                del self._starts[i]
            else:
                self._starts[i] = start + need
                self._lengths[start + need] = length - need
            self._used[start] = need
            self._free_bytes -= need
            self._check()
            return start
        return None

    def _insert(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + length == self._starts[i]:
            following = self._starts.pop(i)
            length += self._lengths.pop(following)
        if i > 0:
            before = self._starts[i - 1]
            if before + self._lengths[before] == offset:
                self._lengths[before] += length
                return
        self._starts.insert(i, offset)
        self._lengths[offset] = length

    def _check(self) -> None:
        assert 0 <= self._free_bytes <= self.size
        assert sum(self._lengths.values()) == self._free_bytes
