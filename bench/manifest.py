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

Figures are in microseconds, the best of several repetitions (the least
disturbed run). Nothing is asserted.

    .venv/bin/python bench/manifest.py [--entries 100000] [--keys 512] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_seconds, emit

from kvharbor.cache.index import Entry, MemoryIndex
from kvharbor.cache.manifest import MANIFEST_FILE, open_manifest
from kvharbor.hal.file import FileDevice

TARGET_CONTAINS_US = 1000.0
ENTRY_BYTES = 1 << 20


def best_us(work: Callable[[], object], repeats: int) -> float:
    return best_seconds(work, repeats) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
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
        repeats = args.repeats
        figures = {
            "contains_us": best_us(lambda: index.contains(probe), repeats),
            "contains_memory_us": best_us(lambda: memory.contains(probe), repeats),
            "admit_evicting_us": best_us(lambda: index.admit(next(fresh), budget), repeats),
            "admit_us": best_us(lambda: index.admit(next(fresh), 2 * budget), repeats),
            "touch_us": best_us(lambda: index.touch([probe[0]]), repeats),
        }
        index.close()
        raw = sqlite3.connect(os.path.join(root, MANIFEST_FILE), isolation_level=None)

        def one_row_transaction() -> None:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("UPDATE meta SET value = value WHERE name = 'clock'")
            raw.execute("COMMIT")

        figures["one_row_transaction_us"] = best_us(one_row_transaction, repeats)
        raw.close()
        figures["open_us"] = best_us(lambda: open_manifest(device, "bench").close(), 3)

    ratios = {
        "contains_vs_target": figures["contains_us"] / TARGET_CONTAINS_US,
        "contains_vs_memory": figures["contains_us"] / figures["contains_memory_us"],
        "admit_vs_one_row_transaction": figures["admit_us"] / figures["one_row_transaction_us"],
    }
    print(f"manifest of {args.entries} entries, lookups of {args.keys} keys (half present), microseconds:")
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
