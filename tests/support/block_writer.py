"""A child process for the block store's crash tests: appends forever, acknowledging on stdout.

    python -m tests.support.block_writer PATH STORE_BYTES REGION_BYTES VALUE_MAX_BYTES

Writes key n with `value_of(n)` for n = 0, 1, ... and prints ``n`` (flushed)
after each put returned: a line read by the parent is an acknowledged object.
Odd keys are put as the cache tier puts from shared memory (a header, then a
block-aligned payload: written from where it lies, a split object), even keys
as one plain ``bytes`` (copied, contiguous), so a crash lands in either kind.
The next, large, put starts at once, so a SIGKILL sent on reading a line lands
inside an append.
"""

from __future__ import annotations

import sys

from kvharbor.hal.block.direct import AlignedBuffer
from kvharbor.hal.block.layout import round_up
from kvharbor.hal.block.store import BlockStoreDevice

MIB = 1 << 20
HEADER_BYTES = 64
"""The cache header's share of a value put in two parts (any small size would do)."""


def key_of(n: int) -> bytes:
    return n.to_bytes(16, "big")


def value_of(n: int, value_max_bytes: int) -> bytes:
    """Between a quarter and all of ``value_max_bytes``, every 8 bytes naming ``n``: a torn
    or misplaced value cannot pass for key n's."""
    nbytes = value_max_bytes // 4 + (n * 1_234_567) % (value_max_bytes * 3 // 4)
    return (n.to_bytes(8, "big") * (nbytes // 8 + 1))[:nbytes]


def main() -> None:
    path, store_bytes, region_bytes, value_max_bytes = sys.argv[1], *map(int, sys.argv[2:5])
    store = BlockStoreDevice(
        "card", path, value_max_bytes, region_bytes=region_bytes, create_bytes=store_bytes, key_eviction=True
    )
    payload = AlignedBuffer(round_up(value_max_bytes))
    n = 0
    while True:
        value = value_of(n, value_max_bytes)
        if n % 2:
            payload.view[: len(value) - HEADER_BYTES] = value[HEADER_BYTES:]
            store.put(key_of(n), [value[:HEADER_BYTES], payload.view[: len(value) - HEADER_BYTES]])
        else:
            store.put(key_of(n), [value])
        print(n, flush=True)
        n += 1


if __name__ == "__main__":
    main()
