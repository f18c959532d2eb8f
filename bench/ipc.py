"""The gateway transport against the physical limit: memcpy, and a round trip.

Against a real ``kvharbor gateway`` subprocess with a RAM tier, in one run:

- **throughput**: put plus get of ``--payload-mb`` (32 MiB) values through the
  transport (prepare, copy in, commit; get, copy out, release), beside a
  memcpy of the same bytes in and out of as much shared memory as the RAM
  tier holds (see `transport`), and beside a memcpy between two buffers that
  stay in the CPU cache. The RAM tier lives in the segment: a put is written
  in place (the client copies the value where it is stored, taking its
  checksum as it goes) and a get is served in place, so a put and a get each
  move the payload once, as the reference does: the physical limit of
  ``transport_vs_memcpy`` is 1.0.
- **several clients**: with 2 and 8 client processes at once (``--clients``),
  their aggregate put+get throughput beside the same processes' memcpy
  reference at once (``transport_vs_memcpy_c2``, ``_c8``): on a machine with
  fewer cores than clients both share the cores.
- **round trips**: p50 and p99 of a LOOKUP of one key, with 1, 2 and 8 client
  processes at once (``--clients``); and of the LOOKUP a scheduler sends for a
  130,000-token prompt (`PROMPT_CHUNKS` keys, all resident in the RAM tier,
  each value's size checked), one client.
- **memory**: the gateway's anonymous RSS per stored key, after ``--keys``
  small values, and what is left of it once any stored bytes held there are
  subtracted (the index and the per-object overhead; values of a RAM tier in
  the segment are shared memory, not anonymous). Beside it, what each value
  takes in the RAM tier: its object (the value and its header) and the tier's
  allocation of it (`kvharbor.hal.slabs`), how many such values its capacity
  holds, and how many of the ``--keys`` it kept (a tier that evicted some
  says so, with how full it was).

Figures are the best of several timings (the least disturbed run) for
throughput, and percentiles over every sample for round trips. Nothing is
asserted; the targets (>= 0.7x memcpy, p50 <= 50 us, p99 <= 500 us with one
client, <= 128 bytes of index per key) are read off.

    .venv/bin/python bench/ipc.py [--payload-mb 32] [--clients 1,2,8] [--json]

With ``--json`` the last line is ``{"figures": {...}, "ratios": {...}}``.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, gateway_process

from kvharbor.cache.format import HEADER_BYTES
from kvharbor.config import MIB, GatewaySection, load_config
from kvharbor.gateway.client import GatewayClient
from kvharbor.hal.checksum import checksum

FINGERPRINT = b"bench-ipc-layout"
PROMPT_CHUNKS = 512
"""Keys of a 130,000-token prompt at 256 tokens per chunk (507, rounded up)."""
PROMPT_VALUE_BYTES = 4096
"""Small stored values: the figure is the index's cost per key, not the bytes'."""
RAM_TIER_PAYLOADS = 4
"""The RAM tier holds this many payloads: after the warm-up it is full, and every put
evicts one value, the steady state of a serving cache."""
WARMUP_ROUNDS = RAM_TIER_PAYLOADS + 2
MEMORY_BATCH = 512
"""Keys per put batch for the memory figure (a batch as an engine stores it: a long prompt)."""
TARGETS = {"transport_vs_memcpy": 0.7, "rtt_p50_us": 50.0, "rtt_p99_us": 500.0, "index_bytes_per_key": 128.0}


# -- the gateway under test ------------------------------------------------------


@contextmanager
def gateway(
    directory: Path, ring_mb: int, ram_gb: float, value_mb_max: int, sections: dict[str, Any] | None = None
) -> Iterator[tuple[GatewaySection, int]]:
    """A ``kvharbor gateway`` subprocess with one RAM tier; yields (its config section, its pid).
    ``sections``: more config sections (``dashboard``, ``telemetry``)."""
    config_path = directory / f"bench-{uuid.uuid4().hex[:6]}.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                **(sections or {}),
                "gateway": {
                    "mode": "service",
                    "socket": str(directory / f"{config_path.stem}.sock"),
                    "shm_name": f"kvh-bench-{uuid.uuid4().hex[:8]}",
                    "ring_mb": ring_mb,
                    "ring_mb_min": 1,
                },
                "storage": {
                    "tiers": [{"name": "ram", "type": "ram", "capacity_gb": ram_gb}],
                    "value_mb_max": value_mb_max,
                    "fallback_path": None,  # RAM only, as measured: no fallback tier beside it.
                },
            }
        )
    )
    with gateway_process(config_path, directory / f"{config_path.stem}.log", 60) as child:
        yield load_config(config_path, environ={}).gateway, child.pid


def rss(pid: int) -> dict[str, int]:
    """VmRSS and its parts (RssAnon, RssShmem), in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


# -- throughput -------------------------------------------------------------------


def transport(section: GatewaySection, nbytes: int, rounds: int, protected: bool = True) -> dict[str, Any]:
    """Best put, best get, best put+get of one ``nbytes`` value through the gateway, in
    seconds, beside two references timed in the same rounds (best of each):

    - ``memcpy``: the copy in and the copy out the transport must do, by plain
      memcpy, through as much shared memory as the RAM tier holds, used in
      the same rotation (each value lands where no recent one did, so it is
      not in the CPU cache): the physical limit of put+get, no protocol.
    - ``hot_memcpy``: a bytearray-to-bytearray copy of the same bytes between
      the same two buffers every time, so both stay in the CPU cache: the
      fastest a copy gets here, a limit no store of new values can reach.

    Also the best xxh3 of the value, and the last key stored.

    ``protected=False`` writes as a GPU client does: its mapping is writable
    throughout (a DMA ignores page protection), so a put changes no page
    protection; with True, each place is made writable for the copy and
    read-only again before the commit, as for any CPU writer."""
    client = GatewayClient.connect(section, "bench-throughput")
    if not protected:
        client.segment.make_writable()
    payload = bytearray(os.urandom(nbytes))
    out = bytearray(nbytes)
    out[:] = payload  # Fault its pages in: the reference copies below into warm memory.
    slots = RAM_TIER_PAYLOADS + 1
    scratch = scratch_shm(slots * nbytes)
    best = dict.fromkeys(("put", "get", "pair", "memcpy", "hot_memcpy", "checksum"), float("inf"))
    pairs = []
    try:
        prefix = os.urandom(8)  # New keys every call: a stored key is skipped, not put.
        for round_ in range(rounds + WARMUP_ROUNDS):
            key = prefix + round_.to_bytes(8, "little")
            start = time.perf_counter()
            batch = client.prepare_put(FINGERPRINT, [(key, nbytes)])
            assert batch.views[0] is not None, "the gateway must take one payload"
            batch.write(0, payload)  # Copied and checksummed in one pass.
            assert client.commit_put(batch) == 1
            middle = time.perf_counter()
            got = client.get(FINGERPRINT, [key])
            # Into a memoryview: ``bytearray[:] = view`` would copy through a temporary.
            memoryview(out)[:] = got.views[0]
            client.release(got)
            end = time.perf_counter()
            slot = scratch[(round_ % slots) * nbytes : (round_ % slots + 1) * nbytes]
            slot[:] = payload  # The reference: memcpy in, then out, through shared memory.
            memoryview(out)[:] = slot
            copied = time.perf_counter()
            out[:] = payload
            hot = time.perf_counter()
            checksum(payload)
            summed = time.perf_counter()
            if round_ >= WARMUP_ROUNDS:
                for name, seconds in (
                    ("put", middle - start),
                    ("get", end - middle),
                    ("pair", end - start),
                    ("memcpy", (copied - end) / 2),
                    ("hot_memcpy", hot - copied),
                    ("checksum", summed - hot),
                ):
                    best[name] = min(best[name], seconds)
                pairs.append(end - start)
        got = client.get(FINGERPRINT, [key])
        assert got.views and got.views[0] == payload, "the value read back differs from the one written"
        client.release(got)
    finally:
        client.close()
        scratch.release()
    return {**best, "pair_median": sorted(pairs)[len(pairs) // 2], "key": key}


def scratch_shm(nbytes: int) -> memoryview:
    """``nbytes`` of populated shared memory (a /dev/shm file, unlinked at once)."""
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="kvh-bench-scratch-")
    try:
        os.unlink(name)
        os.posix_fallocate(fd, 0, nbytes)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return memoryview(mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE))
    finally:
        os.close(fd)


def _throughput_client(
    section: GatewaySection, nbytes: int, rounds: int, slots: int, barrier: Any, results: Any
) -> None:
    """One of several clients: ``rounds`` put+get of its own values, then ``rounds`` of
    the memcpy reference through its own shared memory, each phase started together
    with the other clients (``barrier``). Reports (bytes moved, seconds) per phase."""
    client = GatewayClient.connect(section, f"bench-throughput-{os.getpid()}")
    payload = bytearray(os.urandom(nbytes))
    out = memoryview(bytearray(nbytes))
    out[:] = payload
    scratch = scratch_shm(slots * nbytes)
    prefix = os.urandom(8)
    moved = 0
    barrier.wait()
    start = time.perf_counter()
    for round_ in range(rounds):
        key = prefix + round_.to_bytes(8, "little")
        batch = client.prepare_put(FINGERPRINT, [(key, nbytes)])
        if batch.views[0] is not None:  # Else the ring had no room in time: nothing moved.
            batch.write(0, payload)
        client.commit_put(batch)
        got = client.get(FINGERPRINT, [key])
        for view in got.views:  # Evicted by the other clients' puts meanwhile: none.
            out[:] = view
        client.release(got)
        moved += (batch.views[0] is not None) * nbytes + len(got.views) * nbytes
    transport_s = time.perf_counter() - start
    barrier.wait()
    start = time.perf_counter()
    for round_ in range(rounds):
        slot = scratch[(round_ % slots) * nbytes : (round_ % slots + 1) * nbytes]
        slot[:] = payload
        out[:] = slot
    memcpy_s = time.perf_counter() - start
    client.close()
    scratch.release()
    results.put((moved, transport_s, 2 * rounds * nbytes, memcpy_s))


def throughput_clients(section: GatewaySection, nbytes: int, rounds: int, clients: int) -> dict[str, float]:
    """Aggregate put+get throughput of ``clients`` processes at once, beside the same
    processes' memcpy reference at once (each phase ends with its slowest process)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients)
    results = context.Queue()
    args = (section, nbytes, rounds, RAM_TIER_PAYLOADS + 1, barrier, results)
    workers = [context.Process(target=_throughput_client, args=args) for _ in range(clients)]
    for worker in workers:
        worker.start()
    reports = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join(60)
    transport = sum(r[0] for r in reports) / max(r[1] for r in reports)
    memcpy = sum(r[2] for r in reports) / max(r[3] for r in reports)
    return {"transport_gb_per_s": transport / 1e9, "memcpy_gb_per_s": memcpy / 1e9}


# -- round trips --------------------------------------------------------------------


def _lookup_client(section: GatewaySection, key: bytes, samples: int, barrier: Any, results: Any) -> None:
    client = GatewayClient.connect(section, f"bench-rtt-{os.getpid()}")
    keys = [key]
    for _ in range(min(samples, 500)):  # Warm up: code paths, caches, the gateway thread.
        client.lookup(keys)
    barrier.wait()
    timings = []
    clock = time.perf_counter_ns
    for _ in range(samples):
        start = clock()
        client.lookup(keys)
        timings.append(clock() - start)
    client.close()
    results.put(timings)


def round_trips(section: GatewaySection, key: bytes, clients: int, samples: int) -> list[int]:
    """Nanoseconds of every LOOKUP of one key, from ``clients`` processes at once."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients)
    results = context.Queue()
    workers = [
        context.Process(target=_lookup_client, args=(section, key, samples, barrier, results)) for _ in range(clients)
    ]
    for worker in workers:
        worker.start()
    timings = [t for _ in workers for t in results.get(timeout=300)]
    for worker in workers:
        worker.join(60)
    return sorted(timings)


def _streaming_client(section: GatewaySection, nbytes: int, streaming: Any, stop: Any) -> None:
    """Puts and gets ``nbytes`` values until told to stop: the bulk traffic a lookup
    shares the gateway with while an engine stores and loads prefixes."""
    client = GatewayClient.connect(section, "bench-stream")
    payload = os.urandom(nbytes)
    out = memoryview(bytearray(nbytes))
    round_ = 0
    while not stop.is_set():
        key = b"stream" + os.getpid().to_bytes(4, "little") + round_.to_bytes(6, "little")
        batch = client.prepare_put(FINGERPRINT, [(key, nbytes)])
        if batch.views[0] is not None:
            batch.views[0][:] = payload
        client.commit_put(batch)
        got = client.get(FINGERPRINT, [key])
        for view in got.views:
            out[:] = view
        client.release(got)
        round_ += 1
        streaming.set()
    client.close()


def prompt_round_trips(section: GatewaySection, samples: int) -> list[int]:
    """Nanoseconds of each LOOKUP of a long prompt's `PROMPT_CHUNKS` stored keys, sizes checked."""
    client = GatewayClient.connect(section, "bench-prompt-rtt")
    keys = [os.urandom(16) for _ in range(PROMPT_CHUNKS)]
    batch = client.prepare_put(FINGERPRINT, [(key, PROMPT_VALUE_BYTES) for key in keys])
    for view in batch.views:
        assert view is not None
        view[:] = os.urandom(PROMPT_VALUE_BYTES)
    assert client.commit_put(batch) == PROMPT_CHUNKS
    for _ in range(min(samples, 200)):  # Warm up.
        client.probe(keys, 256, PROMPT_VALUE_BYTES)
    timings = []
    clock = time.perf_counter_ns
    for _ in range(samples):
        start = clock()
        found = client.probe(keys, 256, PROMPT_VALUE_BYTES)
        timings.append(clock() - start)
    assert found.resident == PROMPT_CHUNKS, found
    client.close()
    return sorted(timings)


def round_trips_beside_bulk(section: GatewaySection, key: bytes, samples: int, nbytes: int) -> list[int]:
    """LOOKUP round trips of one client while another streams ``nbytes`` puts and gets."""
    context = multiprocessing.get_context("spawn")
    streaming, stop = context.Event(), context.Event()
    streamer = context.Process(target=_streaming_client, args=(section, nbytes, streaming, stop))
    streamer.start()
    try:
        if not streaming.wait(120):
            raise SystemExit("the streaming client never completed a round")
        return round_trips(section, key, 1, samples)
    finally:
        stop.set()
        streamer.join(120)


def percentile(sorted_values: list[int], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


# -- memory per key ------------------------------------------------------------------


def memory_per_key(section: GatewaySection, pid: int, keys: int, value_bytes: int) -> dict[str, float]:
    """Store ``keys`` values of ``value_bytes`` in the gateway's RAM tier: its RSS per key, and
    what each value takes in the tier (see the module docstring). Per-key figures are over
    the values the tier kept (``ram_kept_keys``; fewer than ``keys`` if it evicted)."""
    client = GatewayClient.connect(section, "bench-memory")
    value = os.urandom(value_bytes)
    try:
        client.lookup([b"\0" * 16])
        before = rss(pid)
        for start in range(0, keys, MEMORY_BATCH):
            items = [(i.to_bytes(16, "little"), value_bytes) for i in range(start, min(keys, start + MEMORY_BATCH))]
            batch = client.prepare_put(FINGERPRINT, items)
            lent = [view for view in batch.views if view is not None]
            for view in lent:
                view[:] = value
            if client.commit_put(batch) != len(items):
                raise SystemExit(
                    f"memory: the gateway stored {len(lent)} of a batch of {len(items)} values of {value_bytes} B "
                    "(no room lent for the rest by the request's deadline: its ring or its RAM tier is full)"
                )
        after = rss(pid)
        status = client.status()
    finally:
        client.close()
    tier = status.store.tiers[0]
    kept = tier.keys
    if kept <= 0:
        raise SystemExit(f"memory: the RAM tier holds no value after {keys} puts: {tier}")
    values_in_segment = status.shm.bytes > status.shm.ring_bytes
    grown = after["RssAnon"] - before["RssAnon"]
    values_anon = 0 if values_in_segment else tier.used_bytes
    allocated = tier.allocated_bytes / kept
    return {
        "rss_bytes_per_key": grown / kept,
        "index_bytes_per_key": (grown - values_anon) / kept,
        "rss_mb": after["VmRSS"] / MIB,
        "rss_anon_mb": after["RssAnon"] / MIB,
        "ram_kept_keys": kept,
        "ram_evictions": tier.counters.evictions,
        "ram_object_bytes_per_key": tier.used_bytes / kept,
        "ram_allocated_bytes_per_key": allocated,
        "ram_overhead_bytes_per_key": allocated - value_bytes,
        "ram_values_fit": tier.capacity_bytes // allocated,
        "ram_capacity_mb": tier.capacity_bytes / MIB,
        "ram_allocated_mb": tier.allocated_bytes / MIB,
    }


def ram_tier_text(figures: dict[str, float], keys: int, value_bytes: int) -> str:
    """What the memory part found in the RAM tier, in a line or two: each value's room in it
    (its object, and the allocation beyond), how many fit, and whether it kept every value."""
    kept, evictions = int(figures["gateway_ram_kept_keys"]), int(figures["gateway_ram_evictions"])
    allocated = figures["gateway_ram_allocated_bytes_per_key"]
    object_bytes = figures["gateway_ram_object_bytes_per_key"]
    capacity_mb, taken_mb = figures["gateway_ram_capacity_mb"], figures["gateway_ram_allocated_mb"]
    text = (
        f"RAM tier: a value of {value_bytes} B takes {allocated:.0f} B, {allocated / value_bytes:.1f} x its size "
        f"(its object {object_bytes:.0f} B with the {HEADER_BYTES} B header, and {allocated - object_bytes:.0f} B "
        f"of allocation); {figures['gateway_ram_values_fit']:.0f} such values fit its {capacity_mb:.0f} MiB"
    )
    if kept == keys:
        return f"{text}; all {keys} kept ({taken_mb:.0f} MiB taken)"
    taken = f"{taken_mb:.0f} of {capacity_mb:.0f} MiB taken"
    return f"{text}\nRAM tier kept only {kept} of {keys}: {evictions} evicted, {taken}"


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload-mb", type=int, default=32, help="value size for throughput, MiB")
    parser.add_argument("--rounds", type=int, default=12, help="timed put+get rounds")
    parser.add_argument("--samples", type=int, default=20_000, help="round trips per client")
    parser.add_argument("--clients", default="1,2,8", help="client process counts for round trips")
    parser.add_argument("--keys", type=int, default=100_000, help="small values stored for the memory figure")
    parser.add_argument("--value-bytes", type=int, default=64, help="size of those values")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    nbytes = args.payload_mb * MIB
    counts = [int(c) for c in args.clients.split(",")]

    figures: dict[str, float] = {"cpus": float(os.cpu_count() or 0), "payload_mib": args.payload_mb}
    with tempfile.TemporaryDirectory(prefix="kvh-bench-") as tmp:
        directory = Path(tmp)
        ring_mb = max(64, 4 * args.payload_mb)
        # Room for RAM_TIER_PAYLOADS values with their headers, not one more.
        ram_gb = (RAM_TIER_PAYLOADS * args.payload_mb + 1) / 1024
        with gateway(directory, ring_mb, ram_gb, value_mb_max=max(args.payload_mb * 2, 64)) as (section, pid):
            moved = transport(section, nbytes, args.rounds)
            unprotected = transport(section, nbytes, args.rounds, protected=False)
            memcpy_s, checksum_s = moved["memcpy"], moved["checksum"]
            figures |= {
                "memcpy_gb_per_s": nbytes / memcpy_s / 1e9,
                "hot_memcpy_gb_per_s": nbytes / moved["hot_memcpy"] / 1e9,
                "checksum_gb_per_s": nbytes / checksum_s / 1e9,
                "put_gb_per_s": nbytes / moved["put"] / 1e9,
                "get_gb_per_s": nbytes / moved["get"] / 1e9,
                "transport_gb_per_s": 2 * nbytes / moved["pair"] / 1e9,
                "transport_dma_style_gb_per_s": 2 * nbytes / unprotected["pair"] / 1e9,
                "memcpy_dma_style_gb_per_s": nbytes / unprotected["memcpy"] / 1e9,
                "transport_median_gb_per_s": 2 * nbytes / moved["pair_median"] / 1e9,
                "memcpy_ms": memcpy_s * 1e3,
                "put_ms": moved["put"] * 1e3,
                "get_ms": moved["get"] * 1e3,
            }
            key = moved["key"]  # Stored by the throughput rounds: a lookup hit.
            for clients in counts:
                timings = round_trips(section, key, clients, args.samples)
                suffix = "" if clients == 1 else f"_c{clients}"
                figures[f"rtt_p50_us{suffix}"] = percentile(timings, 0.50) / 1e3
                figures[f"rtt_p99_us{suffix}"] = percentile(timings, 0.99) / 1e3
                figures[f"lookups_per_s{suffix}"] = clients * 1e9 / (sum(timings) / len(timings))
            prompt = prompt_round_trips(section, max(100, args.samples // 10))
            figures["rtt_p50_us_prompt"] = percentile(prompt, 0.50) / 1e3
            figures["rtt_p99_us_prompt"] = percentile(prompt, 0.99) / 1e3
            beside = round_trips_beside_bulk(section, key, args.samples, nbytes)
            figures["rtt_p50_us_beside_bulk"] = percentile(beside, 0.50) / 1e3
            figures["rtt_p99_us_beside_bulk"] = percentile(beside, 0.99) / 1e3
        several = [c for c in counts if c > 1]
        if several:
            # Room for two values per client in the RAM tier and in flight: a client's
            # value is not evicted by the others' before it reads it back.
            values = 2 * max(several)
            ram_gb = (values * args.payload_mb + 1) / 1024
            with gateway(directory, values * args.payload_mb, ram_gb, max(args.payload_mb * 2, 64)) as (section, _):
                for clients in several:
                    many = throughput_clients(section, nbytes, max(4, args.rounds // 2), clients)
                    figures[f"transport_gb_per_s_c{clients}"] = many["transport_gb_per_s"]
                    figures[f"memcpy_gb_per_s_c{clients}"] = many["memcpy_gb_per_s"]
        ring_mb_small = 64
        ram_gb = max(0.5, args.keys * (args.value_bytes + 200) / 2**30)
        with gateway(directory, ring_mb_small, ram_gb, value_mb_max=1) as (section, pid):
            memory = memory_per_key(section, pid, args.keys, args.value_bytes)
        figures |= {f"gateway_{k}": v for k, v in memory.items()}
        figures["gateway_ring_mb"] = ring_mb_small

    ratios = {
        "transport_vs_memcpy": figures["transport_gb_per_s"] / figures["memcpy_gb_per_s"],
        "transport_vs_hot_memcpy": figures["transport_gb_per_s"] / figures["hot_memcpy_gb_per_s"],
        "transport_dma_style_vs_memcpy": figures["transport_dma_style_gb_per_s"] / figures["memcpy_dma_style_gb_per_s"],
        **{
            f"transport_vs_memcpy_c{c}": figures[f"transport_gb_per_s_c{c}"] / figures[f"memcpy_gb_per_s_c{c}"]
            for c in counts
            if c > 1
        },
        "put_vs_memcpy": figures["put_gb_per_s"] / figures["memcpy_gb_per_s"],
        "get_vs_memcpy": figures["get_gb_per_s"] / figures["memcpy_gb_per_s"],
        "rtt_p50_vs_target": figures["rtt_p50_us"] / TARGETS["rtt_p50_us"],
        "rtt_p99_vs_target": figures["rtt_p99_us"] / TARGETS["rtt_p99_us"],
        "index_bytes_per_key_vs_target": figures["gateway_index_bytes_per_key"] / TARGETS["index_bytes_per_key"],
    }
    print(f"{figures['cpus']:.0f} CPUs; payload {args.payload_mb} MiB; RAM tier")
    print(
        f"memcpy      {figures['memcpy_gb_per_s']:6.2f} GB/s ({figures['memcpy_ms']:.2f} ms) <- physical limit "
        "(through shared memory the size of the RAM tier)"
    )
    print(f"hot memcpy  {figures['hot_memcpy_gb_per_s']:6.2f} GB/s (the same two buffers, in the CPU cache)")
    print(f"put         {figures['put_gb_per_s']:6.2f} GB/s ({figures['put_ms']:.2f} ms)")
    print(f"get         {figures['get_gb_per_s']:6.2f} GB/s ({figures['get_ms']:.2f} ms)")
    print(
        f"put+get     {figures['transport_gb_per_s']:6.2f} GB/s = {ratios['transport_vs_memcpy']:.2f} x memcpy "
        f"(target >= {TARGETS['transport_vs_memcpy']}); {ratios['transport_vs_hot_memcpy']:.2f} x hot memcpy"
    )
    print(
        f"put+get     {figures['transport_dma_style_gb_per_s']:6.2f} GB/s = "
        f"{ratios['transport_dma_style_vs_memcpy']:.2f} x memcpy, writing as a GPU client does (no page protection)"
    )
    for clients in (c for c in counts if c > 1):
        print(
            f"put+get, {clients} clients at once: {figures[f'transport_gb_per_s_c{clients}']:6.2f} GB/s = "
            f"{ratios[f'transport_vs_memcpy_c{clients}']:.2f} x {clients} memcpys at once "
            f"({figures[f'memcpy_gb_per_s_c{clients}']:.2f} GB/s)"
        )
    for clients in counts:
        suffix = "" if clients == 1 else f"_c{clients}"
        print(
            f"LOOKUP rtt, {clients} client(s): p50 {figures['rtt_p50_us' + suffix]:7.1f} us, "
            f"p99 {figures['rtt_p99_us' + suffix]:7.1f} us, {figures['lookups_per_s' + suffix]:9.0f} lookups/s"
        )
    print(
        f"LOOKUP rtt of a 130k-token prompt ({PROMPT_CHUNKS} keys in RAM, sizes checked): "
        f"p50 {figures['rtt_p50_us_prompt']:7.1f} us, p99 {figures['rtt_p99_us_prompt']:7.1f} us"
    )
    print(
        f"LOOKUP rtt beside a 32 MiB put+get stream: p50 {figures['rtt_p50_us_beside_bulk']:7.1f} us, "
        f"p99 {figures['rtt_p99_us_beside_bulk']:7.1f} us"
    )
    print(f"checksum    {figures['checksum_gb_per_s']:6.2f} GB/s (a put's writer takes it while it copies)")
    print(
        f"gateway memory: {figures['gateway_rss_bytes_per_key']:.0f} B RSS per key of {args.value_bytes} B, "
        f"{figures['gateway_index_bytes_per_key']:.0f} B of it beyond the stored object "
        f"(target <= {TARGETS['index_bytes_per_key']:.0f}); RSS {figures['gateway_rss_mb']:.0f} MiB "
        f"for {figures['gateway_ram_kept_keys']:.0f} keys and a {ring_mb_small} MiB ring"
    )
    print(ram_tier_text(figures, args.keys, args.value_bytes))
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
