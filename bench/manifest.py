"""The manifest's hot paths on a warm tier, beside their floors.

- ``contains``: one lookup's worth (512 keys, half present) against a manifest
  of 100 000 entries. Target: <= 1 ms. Floor: `MemoryIndex.contains`, the
  same answer from a dict in this process (what sharing a budget across
  processes costs on top).
- ``admit``: one admission, with and without an eviction. Floor: an empty
  transaction that rewrites one row of the same database, the least any
  admission that is atomic across processes can cost with SQLite.
- ``touch``: one key, as the tier touches on every hit.
- ``open``: `open_manifest` of the sound manifest (its ``quick_check`` reads
  every page).

Figures are the best of several repetitions (the least disturbed run).
Nothing is asserted.

    .venv/bin/python bench/manifest.py [--entries 100000] [--keys 512] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable

from kvharbor.cache.index import Entry, MemoryIndex
from kvharbor.cache.manifest import MANIFEST_FILE, open_manifest
from kvharbor.hal.file import FileDevice

TARGET_CONTAINS_S = 1e-3
ENTRY_BYTES = 1 << 20


def best_seconds(work: Callable[[], object], repeats: int = 7, loops: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            work()
        best = min(best, (time.perf_counter() - start) / loops)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as root:
        device = FileDevice("bench", root, ENTRY_BYTES)
        index = open_manifest(device, "bench")
        entries = [Entry(rng.randbytes(16), ENTRY_BYTES, 1) for _ in range(args.entries)]
        index.rebuild(entries)
        memory = MemoryIndex()
        memory.rebuild(entries)
        half = args.keys // 2
        probe = [e.key for e in rng.sample(entries, half)] + [rng.randbytes(16) for _ in range(args.keys - half)]
        rng.shuffle(probe)

        budget = args.entries * ENTRY_BYTES
        fresh = (Entry(rng.randbytes(16), ENTRY_BYTES // 2, 1) for _ in itertools.count())
        figures = {
            "contains_s": best_seconds(lambda: index.contains(probe)),
            "contains_memory_s": best_seconds(lambda: memory.contains(probe)),
            "admit_evicting_s": best_seconds(lambda: index.admit(next(fresh), budget)),
            "admit_s": best_seconds(lambda: index.admit(next(fresh), 2 * budget)),
            "touch_s": best_seconds(lambda: index.touch([probe[0]])),
        }
        index.close()
        raw = sqlite3.connect(os.path.join(root, MANIFEST_FILE), isolation_level=None)

        def one_row_transaction() -> None:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("UPDATE meta SET value = value WHERE name = 'clock'")
            raw.execute("COMMIT")

        figures["one_row_transaction_s"] = best_seconds(one_row_transaction)
        raw.close()
        figures["open_s"] = best_seconds(lambda: open_manifest(device, "bench").close(), repeats=3, loops=1)

    ratios = {
        "contains_vs_target": figures["contains_s"] / TARGET_CONTAINS_S,
        "contains_vs_memory": figures["contains_s"] / figures["contains_memory_s"],
        "admit_vs_one_row_transaction": figures["admit_s"] / figures["one_row_transaction_s"],
    }
    print(f"manifest of {args.entries} entries, lookups of {args.keys} keys (half present)")
    for name, seconds in figures.items():
        print(f"  {name:28s} {seconds * 1e6:10.1f} us")
    for name, ratio in ratios.items():
        print(f"  {name:28s} {ratio:10.2f} x")
    if args.json:
        print(json.dumps({"figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
