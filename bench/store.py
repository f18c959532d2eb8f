"""Store throughput for 32 MiB values against what the machine itself does with the bytes.

A 32 MiB value is one 256-token chunk of Llama-3.1-8B's KV cache (32 layers x
8 KV heads x 128 x 2 x bf16 x 256 tokens). Measured in the same run, on the
same filesystem, best of several repetitions:

- file tier ``put`` beside a raw write of the same bytes with the same
  durability (a new file, the bytes, fsync of the file, fsync of its
  directory) — the most a crash-safe write can do;
- file tier ``get`` beside a raw ``readinto`` of the same file into a
  preallocated buffer (both read from the page cache);
- RAM tier ``get`` beside a memcpy of the same bytes.

Reads land in a reused buffer, as they do in the gateway (shared memory):
allocating 32 MiB per read would time the page faults, not the store.

    .venv/bin/python bench/store.py [--dir DIR] [--mib 32] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_seconds, emit  # noqa: E402

from kvharbor.cache.assembly import open_store  # noqa: E402
from kvharbor.cache.format import HEADER_BYTES  # noqa: E402
from kvharbor.cache.keys import LayoutFingerprint  # noqa: E402
from kvharbor.config import MIB, validate_config  # noqa: E402
from kvharbor.hal.posix import fsync_dir  # noqa: E402


def raw_write(directory: Path, data: memoryview, counter: itertools.count[int]) -> None:
    path = directory / f"raw-{next(counter)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        written = 0
        while written < data.nbytes:
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(str(directory))
    path.unlink()


def raw_read(path: Path, into: memoryview) -> None:
    with open(path, "rb", buffering=0) as file:
        got = 0
        while got < into.nbytes:
            got += file.readinto(into[got:])  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the file tier lives (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    size = args.mib * MIB
    value = memoryview(bytearray(os.urandom(size)))
    fingerprint = LayoutFingerprint("meta-llama/Llama-3.1-8B", 256).digest()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        directory = Path(root)
        config = validate_config(
            {
                "storage": {
                    "tiers": [
                        {"name": "ram", "type": "ram", "capacity_gb": 4 * size / 2**30},
                        {"name": "local", "type": "file", "path": str(directory / "tier"), "capacity_gb": 64},
                    ]
                }
            }
        )
        store = open_store(config)
        ram, local = store.tiers
        keys = (os.urandom(16) for _ in itertools.count())
        scratch = memoryview(bytearray(size + HEADER_BYTES))

        def reuse(nbytes: int) -> memoryview:
            return scratch[:nbytes]

        def file_put() -> None:
            assert local.write(next(keys), fingerprint, value)

        stored = next(keys)
        assert local.write(stored, fingerprint, value) and ram.write(stored, fingerprint, value)

        def file_get() -> None:
            assert local.read(stored, fingerprint, reuse) is not None

        def ram_get() -> None:
            assert ram.read(stored, fingerprint, reuse) is not None

        counter = itertools.count()
        raw_path = directory / "raw-read"
        raw_path.write_bytes(value)
        target = memoryview(bytearray(size))

        def memcpy() -> None:
            target[:] = value

        seconds = {
            "file_put": best_seconds(file_put, args.repeats),
            "raw_write": best_seconds(lambda: raw_write(directory, value, counter), args.repeats),
            "file_get": best_seconds(file_get, args.repeats),
            "raw_read": best_seconds(lambda: raw_read(raw_path, target), args.repeats),
            "ram_get": best_seconds(ram_get, args.repeats),
            "memcpy": best_seconds(memcpy, args.repeats),
        }
        store.close()

    gbps = {f"{name}_GBps": size / s / 1e9 for name, s in seconds.items()}
    ratios = {
        "file_put_vs_raw_write": seconds["raw_write"] / seconds["file_put"],
        "file_get_vs_raw_read": seconds["raw_read"] / seconds["file_get"],
        "ram_get_vs_memcpy": seconds["memcpy"] / seconds["ram_get"],
    }
    print(f"store throughput, {args.mib} MiB values (best of {args.repeats}):")
    emit({"value_MiB": args.mib, **gbps}, ratios, args.json)


if __name__ == "__main__":
    main()
