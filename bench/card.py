"""The simulated card in virtual time: operations per wall-clock second through the HAL driver.

Each operation goes through the device protocol exactly as the gateway's tier
calls it (`SimCardDevice.put`, ``get``, ``exists``, ``delete``) on virtual time,
so a figure is host CPU per operation: Python's per-call cost through the
driver (its lock, the NVMe status judged, the answer object) and the card
model (write order for key eviction, the unflushed-writes record, the usage
level, the channel heap). Values are 4 KiB, keys from a pool of 64 K, on a card
with key eviction on and room for a quarter of them (it evicts in steady state).
Beside it, the same operations on the card model alone (`SimCard`), to say how
much is the driver's, and an empty Python call, the interpreter's floor.

The block store (`kvharbor.hal.block`): puts and gets of 32 MiB values against
raw sequential O_DIRECT writes and reads of the same bytes, from the memory the
store's puts take them from and into the pages its gets fill, on a file of the same
filesystem (``--dir``), in the same run and
interleaved (`common.interleaved_seconds`): the best round of each, and the median over
rounds of the paired ratio (``…_median``, `common.paired_median_ratio`). Both sides make each value
durable before the next (``fdatasync``), as the store does with ``fsync`` on. A
put is what the cache tier hands the card (``store_put``): a cache header, then
the payload where it lies in (page-aligned) shared memory, with the payload's
checksum its writer took (`BlockStoreDevice.put_checksummed`, as
`EncodedPart.put_on` calls it); ``store_put_hashed`` is the same put without it,
the store hashing the payload itself. A get gives the value back the same way,
its payload on a page edge after the header (``store_get``), and into a buffer at
no particular address (a ``bytearray``: ``store_get_copied``); ``store_get_streamed``
is the cache tier's read, which also takes the payload's checksum (`PayloadChecksum`,
handed the segment digests the store's read took). The store's extra
work per value: on a write the header block's copy and hash (the payload goes to
the device from the caller's memory; only its last partial block is copied),
and the payload's hash in ``store_put_hashed``; on a read the checksum, each
1 MiB segment hashed by the I/O thread that read it (the payload is read into
the caller's memory where its address suits O_DIRECT, else copied there, which
``store_get_copied`` shows). That CPU work overlaps the I/O
(`kvharbor.hal.block.pipeline`) where a core is free for it: on a small machine
busy with other work the read ratio falls with the CPU left over, while the raw
side, all device time, barely moves.

    .venv/bin/python bench/card.py [--ops 200000] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, interleaved_seconds, paired_median_ratio

from kvharbor.cache.format import HEADER_BYTES, PayloadChecksum
from kvharbor.hal.block.direct import AlignedBuffer, open_direct, pwrite_full
from kvharbor.hal.block.layout import BLOCK_BYTES
from kvharbor.hal.block.store import BlockStoreDevice
from kvharbor.hal.checksum import checksum
from kvharbor.hal.posix import read_into
from kvharbor.hal.sim.clock import VirtualClock
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.params import CardParams

VALUE_BYTES = 4096
KEYS = 1 << 16
REPEATS = 5
BLOCK_VALUE_BYTES = 32 << 20
BLOCK_VALUES = 8
"""Values per timed pass of the block-store comparison: 256 MiB, well past any disk cache."""
BLOCK_REPEATS = 9
"""Rounds of the block-store comparison: an odd number, for the median of paired ratios."""


def mixed_ops(device: SimCardDevice, count: int, seed: int) -> Callable[[], None]:
    """``count`` operations: 50 % get, 40 % put, 5 % exists of 8 keys, 5 % delete."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(KEYS)]
    parts = [b"h" * 64, os.urandom(VALUE_BYTES - 64)]
    into = memoryview(bytearray(VALUE_BYTES))
    plan = [(rng.random(), keys[rng.randrange(KEYS)]) for _ in range(count)]
    put, get, exists, delete = device.put, device.get, device.exists, device.delete

    def run() -> None:
        for draw, key in plan:
            if draw < 0.5:
                get(key, into)
            elif draw < 0.9:
                put(key, parts)
            elif draw < 0.95:
                exists([key] * 8)
            else:
                delete(key)

    return run


def model_ops(device: SimCardDevice, count: int, seed: int) -> Callable[[], None]:
    """The same mix on the card model alone, no driver."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(KEYS)]
    value = os.urandom(VALUE_BYTES)
    plan = [(rng.random(), keys[rng.randrange(KEYS)]) for _ in range(count)]
    card = device.card
    store, retrieve, exist, delete = card.store, card.retrieve, card.exist, card.delete

    def run() -> None:
        for draw, key in plan:
            if draw < 0.5:
                retrieve(key)
            elif draw < 0.9:
                store(key, value)
            elif draw < 0.95:
                exist([key] * 8)
            else:
                delete(key)

    return run


def best_rate(make: Callable[[], Callable[[], None]], count: int) -> float:
    """Operations per second, best of `REPEATS` fresh runs (each on a fresh card)."""
    best = 0.0
    for _ in range(REPEATS):
        run = make()
        start = time.perf_counter()
        run()
        best = max(best, count / (time.perf_counter() - start))
    return best


def fresh_card() -> SimCardDevice:
    params = CardParams(capacity_bytes=KEYS // 4 * VALUE_BYTES, value_bytes_max=VALUE_BYTES)
    return SimCardDevice("card", params, VirtualClock())


def write_zeros(path: str, nbytes: int) -> None:
    zeros = bytes(BLOCK_VALUE_BYTES)
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(zeros)):
            f.write(zeros[: min(len(zeros), nbytes - start)])
        os.fsync(f.fileno())


def block_store_seconds(directory: str) -> dict[str, list[float]]:
    """Seconds per pass of `BLOCK_VALUES` values, per round: the store's puts and gets, raw
    writes and reads."""
    raw_path = os.path.join(directory, "raw.blocks")
    store_path = os.path.join(directory, "store.blocks")
    span = BLOCK_VALUES * BLOCK_VALUE_BYTES
    store_bytes = 4 * span + (1 << 20)
    # Both files written through once before timing: a first write into fresh extents costs
    # their allocation and journal commits, which neither side should be timed paying.
    for path, nbytes in ((raw_path, span), (store_path, store_bytes)):
        write_zeros(path, nbytes)
    raw = open_direct(raw_path)
    aligned = AlignedBuffer(BLOCK_VALUE_BYTES)
    aligned.view[:] = os.urandom(BLOCK_VALUE_BYTES)
    # The store: room for four passes, so that FIFO eviction runs in steady state as on a full card.
    store = BlockStoreDevice("card", store_path, BLOCK_VALUE_BYTES)
    # A put as the cache tier makes one from shared memory: its header, then the payload where it lies.
    parts = [memoryview(bytes(aligned.view[:HEADER_BYTES])), aligned.view[: BLOCK_VALUE_BYTES - HEADER_BYTES]]
    writers_checksum = checksum(parts[-1])  # Taken by the writer as it filled the payload.
    # A get's payload lands on a page edge after its header, as a put takes it (`BLOCK_BYTES` apart).
    landing = AlignedBuffer(BLOCK_BYTES + BLOCK_VALUE_BYTES)
    into = landing.view[BLOCK_BYTES - HEADER_BYTES : BLOCK_BYTES - HEADER_BYTES + BLOCK_VALUE_BYTES]
    raw_into = landing.view[BLOCK_BYTES:]  # Page-aligned: the pages `into`'s payload lies in.
    copied_into = memoryview(bytearray(BLOCK_VALUE_BYTES))
    keys = [n.to_bytes(16, "big") for n in range(BLOCK_VALUES)]
    if not (raw.direct and store.direct_io):
        print(f"  note: {directory} refuses O_DIRECT; both sides use buffered I/O")

    def raw_write(n: int) -> None:
        pwrite_full(raw.fd, aligned.view, n * BLOCK_VALUE_BYTES)
        os.fdatasync(raw.fd)

    def raw_read(n: int) -> None:
        # Into the pages a get fills: on these VMs the speed of an O_DIRECT read changed with
        # its destination's pages (0.99 against 1.36 GiB/s, then 1.44 against 1.31, for the
        # same bytes), so each side reads into the same memory, as each side writes from it.
        read_into(raw.fd, raw_into, n * BLOCK_VALUE_BYTES)

    def store_get(into: memoryview) -> Callable[[int], None]:
        def get(n: int) -> None:
            if store.get(keys[n], into) != BLOCK_VALUE_BYTES:
                raise RuntimeError("the block store lost a value it was just given")

        return get

    def store_get_streamed(n: int) -> None:
        payload_checksum = PayloadChecksum()
        got = store.get_streamed(keys[n], into, payload_checksum)
        if got != BLOCK_VALUE_BYTES or payload_checksum.intdigest() != writers_checksum:
            raise RuntimeError("the block store's streamed get gave another payload checksum")

    def each_value(op: Callable[[int], None]) -> Callable[[], None]:
        """One timed pass: ``op`` on each of the `BLOCK_VALUES` values in turn."""

        def run() -> None:
            for n in range(BLOCK_VALUES):
                op(n)

        return run

    passes = {
        "raw_write": raw_write,
        "store_put": lambda n: store.put_checksummed(keys[n], parts, writers_checksum),
        "store_put_hashed": lambda n: store.put(keys[n], parts),
        "raw_read": raw_read,
        "store_get": store_get(into),
        "store_get_copied": store_get(copied_into),
        "store_get_streamed": store_get_streamed,
    }
    try:
        each_value(passes["store_put"])()
        return interleaved_seconds({name: each_value(op) for name, op in passes.items()}, BLOCK_REPEATS)
    finally:
        store.close()
        os.close(raw.fd)
        parts[-1].release()
        into.release()
        raw_into.release()
        landing.close()
        aligned.close()
        os.unlink(raw_path)
        os.unlink(store_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000, help="operations per timed run")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the block-store files go")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.ops <= 0:
        parser.error(f"--ops must be > 0 (got {args.ops})")

    def noop() -> None:
        pass

    def empty_calls() -> Callable[[], None]:
        def run() -> None:
            for _ in range(args.ops):
                noop()

        return run

    card = fresh_card()
    rates = {
        "sim_ops_per_s": best_rate(lambda: mixed_ops(fresh_card(), args.ops, 1), args.ops),
        "sim_model_ops_per_s": best_rate(lambda: model_ops(fresh_card(), args.ops, 1), args.ops),
        "python_empty_calls_per_s": best_rate(empty_calls, args.ops),
    }
    mixed_ops(card, args.ops, 2)()
    figures: dict[str, object] = {name: round(rate) for name, rate in rates.items()}
    figures["card_seconds_per_wall_second"] = round(card.card.clock.now() / (args.ops / rates["sim_ops_per_s"]), 1)
    figures["evicted_keys"] = card.card.counts["evicted_keys"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvharbor-bench-") as directory:
        rounds = block_store_seconds(directory)
    seconds = {name: min(each) for name, each in rounds.items()}
    mib = BLOCK_VALUES * BLOCK_VALUE_BYTES / (1 << 20)
    for name, elapsed in seconds.items():
        figures[f"blockstore_{name}_mib_per_s"] = round(mib / elapsed)
    ratios = {
        "sim_ops_vs_target_200k": rates["sim_ops_per_s"] / 200_000,
        "blockstore_write_vs_raw": seconds["raw_write"] / seconds["store_put"],
        "blockstore_write_hashed_vs_raw": seconds["raw_write"] / seconds["store_put_hashed"],
        "blockstore_read_vs_raw": seconds["raw_read"] / seconds["store_get"],
        "blockstore_read_copied_vs_raw": seconds["raw_read"] / seconds["store_get_copied"],
        "blockstore_read_streamed_vs_raw": seconds["raw_read"] / seconds["store_get_streamed"],
        "blockstore_write_vs_raw_median": paired_median_ratio(rounds["raw_write"], rounds["store_put"]),
        "blockstore_read_vs_raw_median": paired_median_ratio(rounds["raw_read"], rounds["store_get"]),
    }
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
