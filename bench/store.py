"""Store throughput for 32 MiB values against what the machine itself does with the bytes.

A 32 MiB value is one 256-token chunk of Llama-3.1-8B's KV cache (32 layers x
8 KV heads x 128 x 2 x bf16 x 256 tokens). Measured in the same run, on the
same filesystem, best of several repetitions taken in turn (each figure and its
reference come from the same stretch of time):

- file tier ``put`` beside a raw write of the same bytes with the same
  durability (a new file, the bytes, fsync of the file, fsync of its
  directory) — the most a crash-safe write can do. The raw write is timed
  two ways and the faster counts: through the page cache, and with
  ``O_DIRECT`` from page-aligned memory (where the filesystem takes it).
  On a VM whose memory copies are slow, skipping the copy into the page
  cache is much the faster, yet only a writer whose bytes already sit
  aligned in memory and in the file can skip it. The tier is full, as a
  cache is in steady state: each put evicts the least recently used value,
  as each raw write removes the file written as many writes before as the
  tier holds values (`RawWrites`). Both thus write into page-cache pages
  freed alike, and free blocks alike: removing the file just written instead
  made raw writes 15-25% faster on a 2-core VM whose root filesystem is
  mounted with ``discard`` (likely: blocks freed are handed back to the host, and the
  next write into them is slower). A tier that only grows writes into pages never touched
  before, which on a VM whose balloon reports free pages to the host costs
  a host fault per page (~60 ms per 32 MiB measured here, in a raw write
  just the same: nothing the tier does);
- file tier ``put`` with ``direct_writes`` (the payload written with O_DIRECT
  from where it lies, page-aligned) beside the same reference:
  ``file_put_best_vs_raw_write`` is the faster of the two puts;
- the same ``direct_writes`` put handed the value's checksum, as the gateway hands a
  lower tier the checksum its writer sent (``file_put_checksum_known``): the put then
  skips its own hash pass over the value; and the put the gateway makes at the default
  settings, buffered and handed the checksum (``file_put_buffered_checksum_known``);
- file tier ``get`` beside a raw read of the same file into a preallocated
  buffer, all from the page cache, timed two ways and the faster counts:
  ``readinto``, and a copy out of an ``mmap`` of the file (the faster here:
  by ~7% alone, by up to ~1.7x amid this benchmark's other traffic, the
  user-space memcpy beating the kernel's copy). The tier reads with
  ``preadv``: a mapped file truncated from outside, or gone stale on NFS,
  kills its reader with SIGBUS, where ``preadv`` reports the damage;
- the latency of a store ``put`` (RAM tier, then the file tier below it,
  write-through) with the file tier written at once beside the same with it
  written from its queue (``async_writes: true``): what the engine's commit
  waits for. Each timed put starts with the queue empty (it is drained,
  untimed, after each), so the figure is a put's own, not a full queue's drop.
- S3 tier ``put`` and ``get`` beside boto3's own PUT and GET of the same bytes against
  the same server (moto started here, or ``--s3-endpoint``): see ``bench/s3.py``;
- file tier ``get`` of a cold file (its pages dropped from the page cache with
  ``posix_fadvise(DONTNEED)`` before each timed read: this file only, not the
  whole machine's cache as ``drop_caches`` would), buffered and with
  ``cold_reads_direct`` (O_DIRECT), beside a raw cold read of the same bytes
  timed both ways, the faster counting;
- RAM tier ``get`` beside a memcpy of the same bytes.

The put and get ratios of the targets also come as medians of rounds (``…_median``,
`common.paired_median_ratio`): per round, the reference's time over the tier's, timed one
right after the other.

Reads land in a reused, page-aligned buffer, as they do in the gateway (shared
memory, page-aligned extents): allocating 32 MiB per read would time the page
faults, not the store, and a destination off a page edge halves the kernel's
copy out of the page cache on these machines (2.5 GB/s against 10), for the
tier and a raw read alike.

    .venv/bin/python bench/store.py [--dir DIR] [--mib 32] [--json]
        [--no-s3 | --s3-endpoint URL --s3-bucket NAME]
"""

from __future__ import annotations

import argparse
import errno
import itertools
import mmap
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_seconds_interleaved, emit, interleaved_seconds, paired_median_ratio
from s3 import s3_ratios, s3_server, s3_works

from kvharbor.cache.assembly import open_store
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.store import TieredStore
from kvharbor.config import MIB, validate_config
from kvharbor.hal.checksum import checksum
from kvharbor.hal.file import FileDevice
from kvharbor.hal.posix import fsync_dir


class RawWrites:
    """Raw writes of new files, keeping the last ``kept`` and removing the oldest after each
    write, as a full tier of ``kept`` values removes its least recently used one per put."""

    def __init__(self, directory: Path, kept: int) -> None:
        self.directory = directory
        self.kept = kept
        self._files: deque[Path] = deque()
        self._names = itertools.count()

    def write(self, data: memoryview, flags: int = 0) -> None:
        path = self.directory / f"raw-{next(self._names)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
        try:
            written = 0
            while written < data.nbytes:
                written += os.write(fd, data[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(str(self.directory))
        self._files.append(path)
        if len(self._files) > self.kept:
            self._files.popleft().unlink()


def takes_direct_io(directory: Path) -> bool:
    """Whether files here open with ``O_DIRECT`` (tmpfs, for one, refuses it)."""
    probe = directory / "direct-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644))
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def raw_read(path: Path, into: memoryview, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        got = 0
        while got < into.nbytes:
            got += os.readv(fd, [into[got:]])
    finally:
        os.close(fd)


def drop_cached(*paths: Path) -> None:
    """Drop the page-cache pages of ``paths`` (files, or every file under a directory)."""
    for path in paths:
        files = [Path(d) / f for d, _, names in os.walk(path) for f in names] if path.is_dir() else [path]
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def best_cold_seconds(
    works: Mapping[str, tuple[Callable[[], object], Callable[[], None]]], repeats: int
) -> dict[str, float]:
    """The fastest of ``repeats`` timings of each work, each timed once right after its
    ``drop`` (not timed), taken in turn like `best_seconds_interleaved`."""
    best = dict.fromkeys(works, float("inf"))
    for _ in range(repeats):
        for name, (work, drop) in works.items():
            drop()
            start = time.perf_counter()
            work()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def fastest_per_round(rounds: dict[str, list[float]], names: Iterable[str]) -> list[float]:
    """Per round, the fastest of the works ``names`` (a reference timed more than one way)."""
    return [min(each) for each in zip(*(rounds[name] for name in names), strict=True)]


def raw_read_mapped(path: Path, into: memoryview) -> None:
    with open(path, "rb", buffering=0) as file:
        mapped = mmap.mmap(file.fileno(), into.nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
        with mapped, memoryview(mapped) as view:
            into[:] = view


def best_put_seconds(
    stores: dict[str, TieredStore], value: memoryview, fingerprint: bytes, repeats: int
) -> dict[str, float]:
    """The fastest ``put`` of each store, timed in turn; each store's queues are drained
    (untimed) after each put, so every timed put finds them empty."""
    best = dict.fromkeys(stores, float("inf"))
    for _ in range(repeats):
        for name, store in stores.items():
            started = time.perf_counter()
            assert store.put(os.urandom(16), fingerprint, value)
            best[name] = min(best[name], time.perf_counter() - started)
            assert store.settle(60.0), f"{name}: the write queue did not drain in 60 s"
    return best


def put_latency_stores(directory: Path, size: int, values: int) -> dict[str, TieredStore]:
    """A RAM tier over a file tier, write-through, the file tier written at once and from its queue."""
    stores = {}
    for name, deferred in (("put_sync_lower", False), ("put_async_lower", True)):
        tier_bytes = values * (size + HEADER_BYTES) / 2**30
        tiers = [
            {"name": "ram", "type": "ram", "capacity_gb": tier_bytes},
            {"name": "local", "type": "file", "path": str(directory / name), "capacity_gb": tier_bytes,
             "async_writes": deferred},
        ]  # fmt: skip
        stores[name] = open_store(validate_config({"storage": {"tiers": tiers, "async_queue_mb": 4 * size // MIB}}))
    return stores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the file tier lives (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-s3", action="store_true", help="leave the S3 tier out")
    parser.add_argument("--s3-endpoint", default=None, help="an S3 server to measure (default: moto, started here)")
    parser.add_argument("--s3-bucket", default=None, help="its bucket (with --s3-endpoint)")
    args = parser.parse_args()

    size = args.mib * MIB
    full_tier_values = 4  # The stored value read back, and room for puts to evict each other.
    value = memoryview(mmap.mmap(-1, size))  # Page-aligned, as a put's value in the gateway's segment.
    value[:] = os.urandom(size)
    fingerprint = LayoutFingerprint("meta-llama/Llama-3.1-8B", 256).digest()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        directory = Path(root)
        config = validate_config(
            {
                "storage": {
                    "tiers": [
                        {"name": "ram", "type": "ram", "capacity_gb": 4 * size / 2**30},
                        {
                            "name": "local",
                            "type": "file",
                            "path": str(directory / "tier"),
                            "capacity_gb": full_tier_values * (size + HEADER_BYTES) / 2**30,
                        },
                    ]
                }
            }
        )
        store = open_store(config)
        ram, local = store.tiers
        # Keys that share their fan-out directories, as a full tier's keys do (every leaf
        # directory of a cache of many values exists): a young tier pays a mkdir and a
        # directory fsync per new fan-out directory on top, which is not what is measured.
        keys = (bytes(2) + os.urandom(14) for _ in itertools.count())
        scratch = memoryview(mmap.mmap(-1, size + HEADER_BYTES))  # Page-aligned, as the gateway's.

        def reuse(nbytes: int) -> memoryview:
            return scratch[:nbytes]

        stored = next(keys)
        assert local.write(stored, fingerprint, value) and ram.write(stored, fingerprint, value)
        pinned = frozenset({stored})

        device = local.device
        assert isinstance(device, FileDevice)
        direct = takes_direct_io(directory)

        def file_put() -> None:
            device.direct_writes = False
            assert local.write(next(keys), fingerprint, value, pinned)

        for _ in range(full_tier_values):  # Fill the tier: every timed put evicts.
            file_put()

        def file_put_direct() -> None:
            device.direct_writes = True
            assert local.write(next(keys), fingerprint, value, pinned)

        value_checksum = checksum(value)  # What the value's writer sends the gateway with it.

        def file_put_checksum_known() -> None:
            device.direct_writes = direct
            assert local.write(next(keys), fingerprint, value, pinned, value_checksum=value_checksum)

        def file_put_buffered_checksum_known() -> None:  # The gateway's put at the default settings.
            device.direct_writes = False
            assert local.write(next(keys), fingerprint, value, pinned, value_checksum=value_checksum)

        def file_get() -> None:
            assert local.read(stored, fingerprint, reuse) is not None

        def ram_get() -> None:
            assert ram.read(stored, fingerprint, reuse) is not None

        raw = RawWrites(directory, full_tier_values - 1)  # As many as the puts rotate over: all but `stored`.
        raw_writes = {"raw_write_buffered": lambda: raw.write(value)}
        if direct:
            aligned = memoryview(mmap.mmap(-1, size))  # Page-aligned, as O_DIRECT needs.
            aligned[:] = value
            raw_writes["raw_write_direct"] = lambda: raw.write(aligned, os.O_DIRECT)
        raw_path = directory / "raw-read"
        with open(raw_path, "wb") as file:  # Durable, as the tier's: clean pages drop from the cache.
            file.write(value)
            os.fsync(file.fileno())
        target = memoryview(mmap.mmap(-1, size))
        raw_reads = {
            "raw_read_readinto": lambda: raw_read(raw_path, target),
            "raw_read_mmap": lambda: raw_read_mapped(raw_path, target),
        }

        def memcpy() -> None:
            target[:] = value

        rounds = interleaved_seconds(
            {
                "file_put": file_put,
                **({"file_put_direct": file_put_direct} if direct else {}),
                "file_put_checksum_known": file_put_checksum_known,
                "file_put_buffered_checksum_known": file_put_buffered_checksum_known,
                **raw_writes,
                "file_get": file_get,
                **raw_reads,
                "ram_get": ram_get,
                "memcpy": memcpy,
            },
            args.repeats,
        )
        seconds = {name: min(each) for name, each in rounds.items()}

        def file_get_cold(cold_reads_direct: bool) -> Callable[[], None]:
            def work() -> None:
                device.cold_reads_direct = cold_reads_direct
                file_get()

            return work

        def tier_drop() -> None:
            drop_cached(directory / "tier")

        def raw_drop() -> None:
            drop_cached(raw_path)

        cold_works = {
            "file_get_cold_buffered": (file_get_cold(False), tier_drop),
            "raw_read_cold_buffered": (lambda: raw_read(raw_path, target), raw_drop),
        }
        if direct:
            cold_works["file_get_cold_direct"] = (file_get_cold(True), tier_drop)
            cold_works["raw_read_cold_direct"] = (lambda: raw_read(raw_path, target, os.O_DIRECT), raw_drop)
        seconds.update(best_cold_seconds(cold_works, args.repeats))
        device.cold_reads_direct = False
        evictions = local.counters.evictions
        store.close()
        put_stores = put_latency_stores(directory, size, full_tier_values)
        try:
            seconds.update(best_put_seconds(put_stores, value, fingerprint, args.repeats))
        finally:
            for each in put_stores.values():
                each.close()
    assert evictions > 0, "the file tier never filled: its puts were not measured in steady state"

    # The references: the best this machine does.
    seconds["raw_write"] = min(seconds[name] for name in raw_writes)
    seconds["raw_read"] = min(seconds[name] for name in raw_reads)
    latencies = {f"{name}_ms": seconds.pop(name) * 1e3 for name in ("put_sync_lower", "put_async_lower")}
    seconds["raw_read_cold"] = min(seconds[name] for name in cold_works if name.startswith("raw_"))
    seconds["file_get_cold"] = min(seconds[name] for name in cold_works if name.startswith("file_"))
    gbps = {f"{name}_GBps": size / s / 1e9 for name, s in seconds.items()}
    ratios = {
        "put_async_vs_sync_lower": latencies["put_sync_lower_ms"] / latencies["put_async_lower_ms"],
        "file_put_vs_raw_write": seconds["raw_write"] / seconds["file_put"],
        "file_put_best_vs_raw_write": seconds["raw_write"]
        / min(seconds["file_put"], seconds.get("file_put_direct", 1e9)),
        "file_put_checksum_known_vs_raw_write": seconds["raw_write"] / seconds["file_put_checksum_known"],
        "file_put_buffered_checksum_known_vs_raw_write": seconds["raw_write"]
        / seconds["file_put_buffered_checksum_known"],
        "file_get_vs_raw_read": seconds["raw_read"] / seconds["file_get"],
        "file_get_cold_vs_raw_read_cold": seconds["raw_read_cold"] / seconds["file_get_cold"],
        "file_get_cold_buffered_vs_raw_read_cold": seconds["raw_read_cold"] / seconds["file_get_cold_buffered"],
        "ram_get_vs_memcpy": seconds["memcpy"] / seconds["ram_get"],
        # The same two targets as medians of rounds (`common.paired_median_ratio`): a disk
        # whose speed wanders decides a best-of ratio by one lucky repetition of either side.
        "file_put_checksum_known_vs_raw_write_median": paired_median_ratio(
            fastest_per_round(rounds, raw_writes), rounds["file_put_checksum_known"]
        ),
        "file_get_vs_raw_read_median": paired_median_ratio(fastest_per_round(rounds, raw_reads), rounds["file_get"]),
    }
    if not args.no_s3:
        with s3_server(args.s3_endpoint, args.s3_bucket) as server:
            works, s3_store = s3_works(size, fingerprint, server)
            try:
                s3_seconds = best_seconds_interleaved(works, args.repeats)
            finally:
                s3_store.close()
        gbps.update({f"{name}_GBps": size / s / 1e9 for name, s in s3_seconds.items()})
        ratios.update(s3_ratios(s3_seconds))
    if "file_get_cold_direct" in seconds:
        ratios["file_get_cold_direct_vs_raw_read_cold"] = seconds["raw_read_cold"] / seconds["file_get_cold_direct"]
    print(f"store throughput, {args.mib} MiB values (best of {args.repeats}):")
    emit({"value_MiB": args.mib, **gbps, **latencies}, ratios, args.json)


if __name__ == "__main__":
    main()
