"""The gateway process's heap policy: reuse the memory an evicted value leaves.

The RAM tier holds one buffer per value, and values are large (a chunk's KV is
MiBs). glibc serves allocations that large with a fresh ``mmap`` and returns
them with ``munmap`` on free, so in the steady state of a serving cache — a
full tier evicting one value to store the next — every put faults in and
zeroes fresh pages: on a VM that costs three times the copy itself. Served
from the heap, and with the heap never trimmed, the next value reuses the
pages the evicted one had. The RAM tier's budget still bounds the heap, and a
model's chunks all have one size, so the holes eviction leaves fit the next
value.

Process-wide, so only for the gateway process, set before the store opens.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_NEVER = 2**31 - 1
"""The largest threshold mallopt takes: free memory at the heap's top is kept."""


def keep_freed_memory() -> bool:
    """Serve large allocations from one heap and never trim it; False where the C
    library is not glibc (the defaults then stay, and only speed differs)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # One arena: the threads that allocate values take turns on the GIL anyway,
    # and per-thread arenas would each keep their own freed memory.
    applied = all(
        mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_NEVER))
    )
    if not applied:
        _log.info("kvharbor: this C library does not take glibc's heap settings; using its defaults")
    return applied
