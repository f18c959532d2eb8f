"""The gateway under load: several engines, or protocol clients, on one gateway at once.

One service-mode ``kvharbor gateway`` subprocess (a RAM tier in its shared memory;
``--file-tier`` adds a file tier below it) and, on it at once:

- ``--engines 2,4,8``: that many real offline vLLM engine processes of the tiny model
  (`kvharbor.demo.model`, float32, on the CPU, one core each; ``KVHARBOR=1`` pointed at
  the gateway; vLLM's own prefix cache off, so every shared prefix comes from kvharbor),
  each replaying prompts that share `DOCUMENTS` prefixes: the first engine to ask for a
  document computes and stores it, the others load it, and each prompt's own chunk is
  stored;
- ``--tp 2``: one engine of tensor_parallel_size 2 (mp workers, one core per rank) replaying
  the same prompts: both ranks store and load their shard of every chunk;
- ``--clients 2,4,8``: that many processes driving the `GatewayClient` protocol at full
  speed as an engine does per prompt (LOOKUP of its chunks with their value size; GET of
  the hits, copied out, RELEASE; PUT_PREPARE of the rest, copied in with their checksums,
  PUT_COMMIT), with values of the tiny model's chunk size: the gateway's own limit,
  without eight vLLMs' compute on the same cores.

Per case, over the window in which the load runs (engines started, warmed up and let go
together; clients after a warm-up): the requests per second the gateway served (its
``kvharbor_requests_total``, handshakes and status queries left out), the GiB per second
it moved (``put_bytes`` + ``get_bytes`` of its status), its CPU seconds (psutil, all its
threads) per GiB moved and per second of the window (``busy``: 1.0 is one core, which its
Python threads share through one GIL), and the round trips every client process timed
(each request, from its send to its answer; p50 and p99 over all samples, and of LOOKUP
alone: the scheduler waits for it). A client case is the best of ``--repeats`` runs (the
most requests per second: these machines are shared) and says the spread of them all;
an engine case is one run (a vLLM start is dear).

    .venv/bin/python bench/gateway_load.py [--engines 2,4,8] [--clients 2,4,8] [--tp 2]
        [--file-tier] [--seconds 4] [--repeats 3] [--json]

With ``--json`` the last line is ``{"figures": {...}, "ratios": {...}}``. Never asserts
on time.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import struct
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_LINE_PREFIX, EngineProcess, emit, gateway_process, start_engine_process
from ipc import percentile

from kvharbor.cache.keys import KEY_BYTES
from kvharbor.config import GatewaySection, load_config
from kvharbor.demo.model import build_tiny_model
from kvharbor.gateway import protocol as p
from kvharbor.gateway.client import GatewayClient
from kvharbor.gateway.query import GatewayQuery

GIB = 2**30
CHUNK_TOKENS = 256
"""kvharbor's default ``engine.chunk_size``, which the engines use."""
MODEL = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64}
"""`build_tiny_model`'s own defaults, spelled out: the chunk size below follows from them."""
CHUNK_VALUE_BYTES = CHUNK_TOKENS * 2 * MODEL["layers"] * MODEL["kv_heads"] * MODEL["head_dim"] * 4
"""One chunk of the tiny model's KV (K and V of every layer, float32) on one rank: 1 MiB."""
DOCUMENTS = 4
"""Prefixes the prompts share."""
DOCUMENT_CHUNKS = 6
"""Chunks of each shared prefix (1,536 tokens)."""
OWN_TOKENS = 300
"""Each prompt's own tokens after its prefix: one chunk of its own is stored."""
PROMPTS_PER_ENGINE = 24
PROMPTS_PER_GENERATE = 4
"""An engine asks for its prompts this many at a time (one ``LLM.generate``)."""
WARMUP_TOKENS = 64
"""An engine's warm-up prompt: shorter than a chunk, so nothing of it is stored."""
RAM_TIER_GB = 0.5
"""Room for the documents and a few hundred prompts' own chunks: under a client load it
fills within a second and then evicts, the steady state of a serving cache."""
FILE_TIER_GB = 4
RING_MB = 64
"""Puts and gets lie in place in the RAM tier; the ring holds completion marks (and any
value the RAM tier cannot take in place)."""
ENGINE_KV_CACHE_BYTES = 256 * 2**20
"""Each engine's KV cache (vLLM's ``kv_cache_memory_bytes``): 64k tokens of the tiny model,
far more than `PROMPTS_PER_GENERATE` prompts need. ``VLLM_CPU_KVCACHE_SPACE`` counts whole
GiB, and eight engines of 1 GiB each (touched at start) do not fit beside the other work
on a 24 GiB machine; it is left unset, so that vLLM takes this one."""
ENGINE_READY_TIMEOUT_S = 600
"""Longest wait for every engine of a case to start and warm up (eight vLLM starts share
the cores)."""
POLL_S = 0.01
"""How often an engine looks for its start signal, and the bench for the engines' ends."""
CLIENT_WARMUP_PROMPTS = 20
UNCOUNTED_REQUESTS = frozenset({"hello", "status", "locate"})
"""Requests that are no part of the load: handshakes, and the bench's own status queries."""
ROUND_TRIPS_VARIABLE = "KVH_BENCH_ROUND_TRIPS"
"""Set by an engine for the workers vLLM spawns from it: where they record their round trips."""
FINGERPRINT = b"bench-load-print"
"""A layout fingerprint of `KEY_BYTES`, as every fingerprint on the wire."""
CLIENT_PATIENCE_S = 120
"""Longest the bench waits for its clients past a run's length (their start, their last prompt)."""


# -- round trips, timed in every client process ------------------------------------------------


class RoundTrips:
    """Times every request this process's `GatewayClient`\\ s send, from its send to its
    answer, as records of (message type, start on CLOCK_MONOTONIC, duration in ns) in a file
    of this process's own under ``directory``. Installed before vLLM starts, it covers vLLM's
    worker processes (tensor-parallel ranks) too, each writing a file of its own: a forked one
    inherits it, a spawned one (vLLM's CPU build spawns) installs it as it imports this script
    (`ROUND_TRIPS_VARIABLE`). Each record is written at once, since vLLM ends its workers without running their exit
    handlers; ``start`` lets a reader keep the records of one window (the clock is the
    host's, the same in every process)."""

    RECORD = struct.Struct("<HQQ")

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd = -1
        os.register_at_fork(after_in_child=self._close)

    def install(self) -> None:
        original = GatewayClient._call
        record = self._record

        def timed_call(client: GatewayClient, request: p.Message, expect: Any) -> Any:
            start = time.monotonic_ns()
            try:
                return original(client, request, expect)
            finally:
                record(int(request.TYPE), start, time.monotonic_ns() - start)

        GatewayClient._call = timed_call  # type: ignore[method-assign,assignment]

    def _record(self, kind: int, start_ns: int, duration_ns: int) -> None:
        if self._fd < 0:
            path = self.directory / f"rtt-{os.getpid()}.bin"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(self._fd, self.RECORD.pack(kind, start_ns, duration_ns))

    def _close(self) -> None:
        """A forked child writes a file of its own (its parent keeps the inherited one)."""
        self._fd = -1

    @classmethod
    def read(cls, directory: Path, start_ns: int, end_ns: int) -> list[tuple[int, int]]:
        """(message type, duration ns) of every request that started within [start_ns, end_ns)."""
        samples = []
        for path in directory.glob("rtt-*.bin"):
            for kind, start, duration in cls.RECORD.iter_unpack(path.read_bytes()):
                if start_ns <= start < end_ns:
                    samples.append((kind, duration))
        return samples


# -- the gateway ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Served:
    """The gateway's counts at one moment."""

    at_ns: int
    cpu_s: float
    requests: int
    moved_bytes: int


class LoadedGateway:
    """The gateway under test, and how to read what it did."""

    def __init__(self, config_path: Path, section: GatewaySection, pid: int) -> None:
        self.config_path = config_path
        self.section = section
        self.process = psutil.Process(pid)
        with GatewayQuery.connect(section) as query:
            url = query.status().metrics_url
        if url is None:
            raise SystemExit("bench: the gateway serves no /metrics (its dashboard did not start): see its log")
        self.metrics_url = url

    def served(self) -> Served:
        """Its counts now. The status query and the scrape cost the gateway a few ms of CPU,
        well under 1% of a window."""
        at_ns = time.monotonic_ns()
        times = self.process.cpu_times()
        with GatewayQuery.connect(self.section) as query:
            counters = query.status().counters
        with urllib.request.urlopen(self.metrics_url, timeout=10) as answer:
            text = answer.read().decode()
        requests = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "kvharbor_requests"
            for sample in family.samples
            if sample.name == "kvharbor_requests_total" and sample.labels["type"] not in UNCOUNTED_REQUESTS
        )
        moved = counters["put_bytes"] + counters["get_bytes"]
        return Served(at_ns, times.user + times.system, int(requests), moved)


@contextmanager
def loaded_gateway(directory: Path, file_tier: bool) -> Iterator[LoadedGateway]:
    """A ``kvharbor gateway`` subprocess with a RAM tier (and a file tier below it)."""
    tiers: list[dict[str, Any]] = [{"name": "ram", "type": "ram", "capacity_gb": RAM_TIER_GB}]
    if file_tier:
        tiers.append({"name": "local", "type": "file", "path": str(directory / "files"), "capacity_gb": FILE_TIER_GB})
    config_path = directory / f"load-{uuid.uuid4().hex[:6]}.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "gateway": {
                    "mode": "service",
                    "socket": str(directory / f"{config_path.stem}.sock"),
                    "shm_name": f"kvh-load-{uuid.uuid4().hex[:8]}",
                    "ring_mb": RING_MB,
                    "ring_mb_min": 1,
                },
                "storage": {"tiers": tiers, "fallback_path": None},  # The tiers named, nothing beside them.
                # Ports the system picks: /metrics is read from the one it says in its status.
                "dashboard": {"port": 0},
                "telemetry": {"prometheus": {"port": 0}},
            }
        )
    )
    with gateway_process(config_path, directory / f"{config_path.stem}.log", 60) as child:
        yield LoadedGateway(config_path, load_config(config_path, environ={}).gateway, child.pid)


# -- the figures of one case ------------------------------------------------------------------


def case_figures(case: str, before: Served, after: Served, samples: Sequence[tuple[int, int]]) -> dict[str, float]:
    wall_s = (after.at_ns - before.at_ns) / 1e9
    moved_gib = (after.moved_bytes - before.moved_bytes) / GIB
    cpu_s = after.cpu_s - before.cpu_s
    every = sorted(duration for _, duration in samples)
    lookups = sorted(duration for kind, duration in samples if kind == p.MessageType.LOOKUP)
    figures = {
        f"{case}_window_s": wall_s,
        f"{case}_requests_per_s": (after.requests - before.requests) / wall_s,
        f"{case}_gib_per_s": moved_gib / wall_s,
        f"{case}_gateway_cpu_s_per_gib": cpu_s / moved_gib if moved_gib else float("nan"),
        f"{case}_gateway_busy": cpu_s / wall_s,
        f"{case}_rtt_samples": float(len(every)),
    }
    for name, timings in (("rtt", every), ("lookup_rtt", lookups)):
        if timings:
            figures[f"{case}_{name}_p50_us"] = percentile(timings, 0.50) / 1e3
            figures[f"{case}_{name}_p99_us"] = percentile(timings, 0.99) / 1e3
    return figures


# -- client processes -------------------------------------------------------------------------


def document_keys() -> list[list[bytes]]:
    """The chunk keys of every shared prefix: the same in every process."""
    return [
        [
            hashlib.blake2b(f"document {d} chunk {c}".encode(), digest_size=KEY_BYTES).digest()
            for c in range(DOCUMENT_CHUNKS)
        ]
        for d in range(DOCUMENTS)
    ]


@dataclass(frozen=True, slots=True)
class ClientLoad:
    section: GatewaySection
    round_trips: Path
    value_bytes: int
    seconds: float
    repeats: int


def _load_client(load: ClientLoad, index: int, barrier: Any) -> None:
    """One client: prompts as an engine sends them, for ``load.seconds`` per repetition;
    each repetition starts and ends at ``barrier`` (the bench reads the gateway there)."""
    RoundTrips(load.round_trips).install()
    client = GatewayClient.connect(load.section, f"bench-load-{index}")
    documents = document_keys()
    size = load.value_bytes
    value = os.urandom(size)
    out = memoryview(bytearray(size))
    choose = random.Random(index).randrange
    prefix = os.urandom(KEY_BYTES - 8)
    own = itertools.count()

    def prompt() -> None:
        keys = [*documents[choose(DOCUMENTS)], prefix + next(own).to_bytes(8, "little")]
        hits = client.probe(keys, CHUNK_TOKENS, size).hits
        if hits:
            got = client.get(FINGERPRINT, keys[:hits])
            for view in got.views:
                out[:] = view
            client.release(got)
        if hits < len(keys):
            batch = client.prepare_put(FINGERPRINT, [(key, size) for key in keys[hits:]])
            for i, place in enumerate(batch.views):
                if place is not None:  # Else stored meanwhile by another client, or no room.
                    batch.write(i, value)
            client.commit_put(batch)

    for _ in range(CLIENT_WARMUP_PROMPTS):
        prompt()
    for _ in range(load.repeats):
        barrier.wait()
        deadline = time.monotonic() + load.seconds
        while time.monotonic() < deadline:
            prompt()
        barrier.wait()
    client.close()


def client_case(
    gateway: LoadedGateway, clients: int, value_bytes: int, seconds: float, repeats: int, workdir: Path
) -> dict[str, float]:
    """``clients`` processes at full speed, ``repeats`` times: the figures of the run that
    served the most requests per second, and the spread of that figure over them all."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients + 1)
    round_trips = workdir / f"rtt-clients{clients}"
    round_trips.mkdir()
    load = ClientLoad(gateway.section, round_trips, value_bytes, seconds, repeats)
    workers = [context.Process(target=_load_client, args=(load, i, barrier)) for i in range(clients)]
    for worker in workers:
        worker.start()
    windows = []
    try:
        for _ in range(repeats):
            before = gateway.served()
            barrier.wait(seconds + CLIENT_PATIENCE_S)  # Every client is waiting here: the window opens.
            barrier.wait(seconds + CLIENT_PATIENCE_S)  # Every client has finished its repetition.
            windows.append((before, gateway.served()))
    except threading.BrokenBarrierError:
        for worker in workers:
            worker.kill()
        raise SystemExit(f"bench: a client process failed (exit codes {[w.exitcode for w in workers]})") from None
    for worker in workers:
        worker.join(60)
    case = f"clients{clients}"
    runs = [case_figures(case, b, a, RoundTrips.read(round_trips, b.at_ns, a.at_ns)) for b, a in windows]
    rates = [run[f"{case}_requests_per_s"] for run in runs]
    best = runs[rates.index(max(rates))]
    return {**best, f"{case}_requests_per_s_spread": (max(rates) - min(rates)) / max(rates)}


# -- engine processes -------------------------------------------------------------------------


def engine_main(spec_path: str) -> None:
    """One engine: warm up, say so, wait for the start signal, replay its prompts, say so."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ[ROUND_TRIPS_VARIABLE] = spec["round_trips"]  # For the workers vLLM spawns.
    RoundTrips(Path(spec["round_trips"])).install()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=False,  # Every repeated prefix must come from kvharbor.
        kv_cache_memory_bytes=ENGINE_KV_CACHE_BYTES,
        **spec["llm"],
    )
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
    Path(spec["ready"]).touch()
    while not Path(spec["go"]).exists():
        time.sleep(POLL_S)
    cached = 0
    for start in range(0, len(spec["prompts"]), PROMPTS_PER_GENERATE):
        prompts = [TokensPrompt(prompt_token_ids=t) for t in spec["prompts"][start : start + PROMPTS_PER_GENERATE]]
        cached += sum(output.num_cached_tokens or 0 for output in llm.generate(prompts, one, use_tqdm=False))
    Path(spec["done"]).touch()
    print(BENCH_LINE_PREFIX + json.dumps({"cached_tokens": cached}), flush=True)


class EngineLoad:
    """Everything the engine cases share: the model, the documents, where they run."""

    def __init__(self, workdir: Path, gateway: LoadedGateway) -> None:
        self.workdir = workdir
        self.gateway = gateway
        self.model = build_tiny_model(workdir / "model", **MODEL)
        rng = random.Random(40)
        self.documents = [
            [rng.randrange(4, 4096) for _ in range(DOCUMENT_CHUNKS * CHUNK_TOKENS)] for _ in range(DOCUMENTS)
        ]
        self.rng = rng
        self.tmp = workdir / "tmp"
        self.tmp.mkdir()

    def prompts(self, engine: int) -> list[list[int]]:
        """Engine ``engine``'s prompts: the documents in turn (each engine from its own), each
        followed by tokens of that prompt's own."""
        return [
            self.documents[(engine + i) % DOCUMENTS] + [self.rng.randrange(4, 4096) for _ in range(OWN_TOKENS)]
            for i in range(PROMPTS_PER_ENGINE)
        ]

    def run(self, case: str, engines: Sequence[tuple[dict[str, Any], dict[str, str]]]) -> dict[str, float]:
        """The engines of one case (each its ``LLM`` options and environment) at once, timed from
        the moment all of them are warm to the moment all of them are done."""
        folder = self.workdir / case
        round_trips = folder / "rtt"
        round_trips.mkdir(parents=True)
        go = folder / "go"
        processes = []
        for i, (llm, env) in enumerate(engines):
            spec = {
                "model": str(self.model),
                "llm": llm,
                "warmup": [self.rng.randrange(4, 4096) for _ in range(WARMUP_TOKENS)],
                "prompts": self.prompts(i),
                "round_trips": str(round_trips),
                "ready": str(folder / f"ready-{i}"),
                "done": str(folder / f"done-{i}"),
                "go": str(go),
            }
            variables: dict[str, str | None] = {
                "KVHARBOR": "1",
                "KVHARBOR_CONFIG": str(self.gateway.config_path),
                "VLLM_CPU_KVCACHE_SPACE": None,
                **env,
            }
            processes.append(start_engine_process(__file__, spec, variables, folder, self.tmp, f"{case}-{i}"))
        wait_for([folder / f"ready-{i}" for i in range(len(engines))], processes, ENGINE_READY_TIMEOUT_S)
        before = self.gateway.served()
        go.touch()
        wait_for([folder / f"done-{i}" for i in range(len(engines))], processes, ENGINE_READY_TIMEOUT_S)
        after = self.gateway.served()
        cached = sum(process.report()["cached_tokens"] for process in processes)
        figures = case_figures(case, before, after, RoundTrips.read(round_trips, before.at_ns, after.at_ns))
        figures[f"{case}_restored_tokens"] = float(cached)
        return figures


def wait_for(signals: Sequence[Path], processes: Sequence[EngineProcess], timeout_s: float) -> None:
    """Until every engine has touched its file of ``signals``; one that exits before (its log
    says why) ends the bench."""
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() for path in signals):
        for path, process in zip(signals, processes, strict=True):
            if process.child.poll() is not None and not path.exists():
                raise SystemExit(f"bench: the engine {process.name} exited early; its log: {process.log_path}")
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: the engines took over {timeout_s} s; their logs are in {signals[0].parent}")
        time.sleep(POLL_S)


# -- main -------------------------------------------------------------------------------------


def counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=counts, default=[2, 4, 8], help="engine process counts (default: 2,4,8)")
    parser.add_argument("--clients", type=counts, default=[2, 4, 8], help="client process counts (default: 2,4,8)")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size of the TP case; 0: none")
    parser.add_argument(
        "--value-kib",
        type=int,
        default=CHUNK_VALUE_BYTES // 1024,
        help="the clients' value size in KiB (default: the tiny model's chunk, %(default)s); small values leave "
        "the gateway's own cost per request",
    )
    parser.add_argument("--file-tier", action="store_true", help="a file tier below the RAM tier")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one client run")
    parser.add_argument("--repeats", type=int, default=3, help="client runs per count; the best is kept")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(args.engine)
        return

    cpus = os.cpu_count() or 1
    figures: dict[str, Any] = {
        "cpus": float(cpus),
        "cpu": cpu_model(),
        "tiers": "ram+file" if args.file_tier else "ram",
        "client_value_bytes": float(args.value_kib * 1024),
        "engine_value_bytes": float(CHUNK_VALUE_BYTES),
    }
    with tempfile.TemporaryDirectory(prefix="kvh-bench-load-") as tmp:
        workdir = Path(tmp)
        with loaded_gateway(workdir, args.file_tier) as gateway:
            for clients in args.clients:
                figures |= client_case(gateway, clients, args.value_kib * 1024, args.seconds, args.repeats, workdir)
                report(figures, f"clients{clients}")
            if args.engines or args.tp:
                engines = EngineLoad(workdir, gateway)
                for n in args.engines:
                    # One core each, in turn: vLLM's CPU worker binds its OpenMP threads, and
                    # n engines each spinning on every core would starve the gateway.
                    one_core: list[tuple[dict[str, Any], dict[str, str]]] = [
                        ({}, {"VLLM_CPU_OMP_THREADS_BIND": str(i % cpus)}) for i in range(n)
                    ]
                    figures |= engines.run(f"engines{n}", one_core)
                    report(figures, f"engines{n}")
                if args.tp:
                    tp = {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"}
                    bind = "|".join(str(rank % cpus) for rank in range(args.tp))  # One core per rank.
                    figures |= engines.run(f"tp{args.tp}", [(tp, {"VLLM_CPU_OMP_THREADS_BIND": bind})])
                    report(figures, f"tp{args.tp}")
    ratios = {}
    first = f"clients{args.clients[0]}" if args.clients else None
    for clients in args.clients[1:]:
        ratios[f"requests_per_s_clients{clients}_vs_{first}"] = (
            figures[f"clients{clients}_requests_per_s"] / figures[f"{first}_requests_per_s"]
        )
    for n in args.engines:
        if n in args.clients:
            ratios[f"requests_per_s_engines{n}_vs_clients{n}"] = (
                figures[f"engines{n}_requests_per_s"] / figures[f"clients{n}_requests_per_s"]
            )
    print(
        f"{cpus} CPUs ({figures['cpu']}); values of {args.value_kib} KiB (clients), {CHUNK_VALUE_BYTES // 1024} KiB "
        f"(engines); tiers {figures['tiers']}"
    )
    emit(figures, ratios, args.json)


def report(figures: dict[str, Any], case: str) -> None:
    print(
        f"{case:<10} {figures[f'{case}_requests_per_s']:8.0f} requests/s, {figures[f'{case}_gib_per_s']:5.2f} GiB/s, "
        f"rtt p50 {figures.get(f'{case}_rtt_p50_us', float('nan')):7.1f} us p99 "
        f"{figures.get(f'{case}_rtt_p99_us', float('nan')):8.1f} us, gateway {figures[f'{case}_gateway_busy']:.2f} "
        f"cores, {figures[f'{case}_gateway_cpu_s_per_gib']:.3f} CPU s/GiB",
        flush=True,
    )


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and ROUND_TRIPS_VARIABLE in os.environ:
    # A worker vLLM spawned from an engine (a tensor-parallel rank) imports this script as its
    # main module first: its requests are timed too.
    RoundTrips(Path(os.environ[ROUND_TRIPS_VARIABLE])).install()
