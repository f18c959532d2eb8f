"""Page-aligned extents of a fixed region: the allocator behind shared memory.

The gateway's transfer ring lends extents per transfer (a client or the
gateway fills one, the other side reads it in place, then it is freed); the
shared RAM tier keeps each stored object in one. When the region is full a
request may wait until its deadline and is then refused (backpressure): a put
is then skipped and a get is a miss, never a stalled engine.

The deadline is per request, not per extent: a batch of many values must not
wait ``ring_wait_ms`` once for each, or a full ring would hold a request far
past the client's ``request_timeout_ms``.
"""

from __future__ import annotations

import bisect
import threading
import time

PAGE_BYTES = 4096
"""Allocation granularity: page alignment keeps O_DIRECT, mprotect and CUDA host registration possible."""


def round_up(nbytes: int) -> int:
    assert nbytes >= 0, nbytes
    return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)


class Extents:
    """First-fit allocator over [0, size) with coalescing free extents.

    Free extents are kept sorted by start (``_starts``) with their lengths
    (``_lengths``); an allocation or a free is O(free extents), which stays
    small because neighbours coalesce. Extents in use are not tracked here:
    their owner knows each one's offset and size and gives both back (a RAM
    tier holds millions, and a table of them would cost ~100 bytes each).
    """

    def __init__(self, size: int) -> None:
        assert size > 0 and size % PAGE_BYTES == 0, size
        self.size = size
        self._starts: list[int] = [0]
        self._lengths: dict[int, int] = {0: size}
        self._free_bytes = size
        self._cond = threading.Condition()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def allocate(self, nbytes: int, deadline: float | None = None) -> int | None:
        """Offset of ``nbytes`` (rounded up to pages), or None if no room came by
        ``deadline`` (a `time.monotonic` instant; None: do not wait)."""
        need = round_up(nbytes)
        if need > self.size:
            return None  # Could never fit: no point in waiting.
        with self._cond:
            while True:
                offset = self._take(need)
                if offset is not None:
                    return offset
                remaining = 0.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def free(self, offset: int, nbytes: int) -> int:
        """Give back the extent `allocate` returned at ``offset`` for ``nbytes``; returns
        its length (whole pages). An extent freed twice is caught while it is free."""
        length = round_up(nbytes)
        with self._cond:
            assert offset % PAGE_BYTES == 0 and offset + length <= self.size, (offset, length, self.size)
            self._free_bytes += length
            self._insert(offset, length)
            assert 0 < self._free_bytes <= self.size
            self._cond.notify_all()
        return length

    def check(self) -> None:
        """Full consistency check, O(free extents): sorted, page-aligned, apart (a free
        neighbour would have coalesced), inside [0, size), adding up to `free_bytes`."""
        with self._cond:
            assert sorted(self._lengths) == self._starts
            assert sum(self._lengths.values()) == self._free_bytes
            end = -1
            for start in self._starts:
                length = self._lengths[start]
                assert start > end and length > 0 and start % PAGE_BYTES == 0 == length % PAGE_BYTES, (start, end)
                end = start + length
            assert end <= self.size, (end, self.size)

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
            self._free_bytes -= need
            assert 0 <= self._free_bytes < self.size
            return start
        return None

    def _insert(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        assert i == len(self._starts) or offset + length <= self._starts[i], "extent freed twice"
        if i < len(self._starts) and offset + length == self._starts[i]:
            following = self._starts.pop(i)
            length += self._lengths.pop(following)
        if i > 0:
            before = self._starts[i - 1]
            assert before + self._lengths[before] <= offset, "extent freed twice"
            if before + self._lengths[before] == offset:
                self._lengths[before] += length
                return
        self._starts.insert(i, offset)
        self._lengths[offset] = length
