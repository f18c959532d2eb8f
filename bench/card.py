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

The issue's block-store ratios (``blockstore_write_vs_raw``, ``blockstore_read_vs_raw``)
come with the block store, which is not built yet.

    .venv/bin/python bench/card.py [--ops 200000] [--json]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit

from kvharbor.hal.sim.clock import VirtualClock
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.params import CardParams

VALUE_BYTES = 4096
KEYS = 1 << 16
REPEATS = 5


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000, help="operations per timed run")
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
    emit(figures, {"sim_ops_vs_target_200k": rates["sim_ops_per_s"] / 200_000}, args.json)


if __name__ == "__main__":
    main()
