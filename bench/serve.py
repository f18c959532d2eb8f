"""Under load, on a real trace: kvharbor beside vLLM's own offloading and no connector at all.

Replays a slice of a Mooncake-format trace (`bench/replay.py`) against a real vLLM
OpenAI server, once per mode, one mode after another on the same engine settings,
the same slice and the same host-memory and disk budgets:

- ``none``: vLLM's GPU prefix cache only;
- ``vllm-cpu``: vLLM's ``OffloadingConnector`` with its CPU tier (``--cpu-gb``);
- ``vllm-cpu-fs``: the same with its file-system secondary tier (``TieringOffloadingSpec``,
  a ``fs`` tier under ``--out``; vLLM's fs tier has no capacity bound: the bytes it
  wrote are reported beside ``--disk-gb``);
- ``kvharbor``: ``KVHARBOR=1`` with the default embedded gateway, a RAM tier of
  ``--cpu-gb`` and a file tier of ``--disk-gb``.

``--restart`` stops each mode's engine half-way through the slice (SIGTERM, vLLM's
default shutdown) and starts a new one on the same settings; the second half's
clock starts when the new engine serves. Per mode: requests per second, output tokens
per second, TTFT p50/p90/p99, time per output token p50/p99, the token hit rate by
where the hit came from (the GPU's prefix cache, host RAM, storage), prompt tokens
computed, bytes loaded and stored, the hit rate and TTFT p50 per ``--window-s`` window;
with ``--restart`` also what the second half hit of what only the first half had sent
(`replay.reuse_from_before`). The hit tokens by source are the engine's own counters
(``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``), checked against the
cached tokens the server reported per request (``accounting``). ``--plan`` runs
``kvharbor plan`` on the same scaled slice and capacity and sets its predicted token hit
rate beside the measured one.

    .venv/bin/python bench/serve.py --requests 200 --clients 2 [--restart] [--modes ...] [--json]
    python3 bench/serve.py --model DIR --load-format dummy --rate 4 --requests 500 ...   # on a GPU

Output: one ``MODE {json}`` line per mode, a table, ``--out``/serve.json (every mode),
``requests-<mode>.jsonl`` (every request), ``slice.jsonl`` (the scaled slice, for
``kvharbor plan``) and ``ttft.png`` (TTFT over time per mode); with ``--json`` the last
line is ``{"figures": {...}, "ratios": {...}}``. A mode whose engine does not start is
reported with the reason from its log; the others still run. Never asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(REPO))

from common import emit  # noqa: E402
from replay import Client, Outcome, ReplayError, Shape, Workload, replay, reuse_from_before, summary, windows  # noqa: E402

from kvharbor.demo.server import ServerError, VllmServer  # noqa: E402

MODES = ("none", "vllm-cpu", "vllm-cpu-fs", "kvharbor")
TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
GIB = 1 << 30
START_TIMEOUT_S = 600.0
"""Bound on one engine's start (a GPU engine with dummy weights: ~60 s first, ~20 s after)."""
ENGINE_COUNTERS = (
    "vllm:kvharbor_",
    "vllm:kv_offload",
    "vllm:prefix_cache",
    "vllm:external_prefix",
    "vllm:prompt_tokens",
)
"""The engine's counters each mode's result carries as they were read (their deltas over the run)."""
REASON_LINES = 3
"""Lines of a failed engine's log that say why (its last lines naming an error)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """What every mode may use beside the GPU."""

    cpu_bytes: int
    disk_bytes: int


@dataclass(frozen=True, slots=True)
class Mode:
    """One way of running the engine: its connector config and environment."""

    name: str
    transfer: dict[str, Any] | None
    """``--kv-transfer-config`` (None: none given)."""
    env: dict[str, str]
    kvharbor_config: Path | None = None


def make_mode(name: str, budget: Budget, work: Path, chunk_tokens: int) -> Mode:
    """The engine settings of mode ``name``; its files under ``work`` (made here)."""
    if name not in MODES:
        raise ReplayError(f"--modes: unknown mode {name!r}; known: {', '.join(MODES)}")
    work.mkdir(parents=True, exist_ok=True)
    if name == "none":
        return Mode(name, None, {})
    if name == "vllm-cpu":
        return Mode(name, offloading({"cpu_bytes_to_use": budget.cpu_bytes}), {})
    if name == "vllm-cpu-fs":
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": budget.cpu_bytes,
            "secondary_tiers": [{"type": "fs", "root_dir": str(work / "vllm-fs")}],
        }
        return Mode(name, offloading(extra), {})
    config = work / "kvharbor.yaml"
    config.write_text(yaml.safe_dump(kvharbor_document(budget, work, chunk_tokens)))
    return Mode(name, None, {"KVHARBOR": "1", "KVHARBOR_CONFIG": str(config)}, config)


def offloading(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``OffloadingConnector`` with ``extra`` as its spec's settings."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def kvharbor_document(budget: Budget, work: Path, chunk_tokens: int) -> dict[str, Any]:
    """kvharbor's config for the run: the default embedded gateway, its socket and segment
    of the run's own, a RAM tier and a file tier of the budgets."""
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"kvh-serve-{os.getpid()}"
    runtime.mkdir(parents=True, exist_ok=True)
    return {
        "engine": {"chunk_size": chunk_tokens},
        # Lingering past a restart (the next engine attaches within a minute or two), but not
        # for the default 600 s: its RAM tier would hold the host RAM the next mode is given.
        "gateway": {"socket": str(runtime / "gw.sock"), "shm_name": f"kvh-serve-{os.getpid()}", "linger_s": 180},
        "storage": {
            "tiers": [
                {"name": "ram", "type": "ram", "capacity_gb": budget.cpu_bytes / GIB},
                {
                    "name": "disk",
                    "type": "file",
                    "path": str(work / "kvharbor-files"),
                    "capacity_gb": budget.disk_bytes / GIB,
                },
            ],
            "fallback_path": None,
        },
        "dashboard": {"port": 0},
        "telemetry": {"prometheus": {"port": 0}},
    }


# -- the engine's own counters ----------------------------------------------------------


def scrape(server: VllmServer) -> dict[str, float]:
    """Every sample of the server's ``/metrics``, summed over labels but ``source`` and ``tier``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            kept = {k: v for k, v in sample.labels.items() if k in ("source", "tier")}
            name = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(kept.items()))
            found[name] = found.get(name, 0.0) + sample.value
    return found


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def added(totals: dict[str, float], more: Mapping[str, float]) -> None:
    for name, value in more.items():
        totals[name] = totals.get(name, 0.0) + value


def gateway_tiers(config: Path | None) -> dict[str, dict[str, int]]:
    """kvharbor's tiers' counters (hits, puts, bytes), by tier name; {} when no gateway answers."""
    if config is None:
        return {}
    from kvharbor.config import load_config
    from kvharbor.gateway.client import GatewayClient, GatewayError

    try:
        client = GatewayClient.connect(load_config(config, {}).gateway, "bench serve")
    except GatewayError:
        return {}
    try:
        return {tier.name: asdict(tier.counters) for tier in client.status().store.tiers}
    finally:
        client.close()


def tier_delta(
    after: Mapping[str, Mapping[str, Any]], before: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, int]]:
    return {
        name: {k: int(v) - int(before.get(name, {}).get(k, 0)) for k, v in counts.items() if isinstance(v, int)}
        for name, counts in after.items()
    }


# -- one mode -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Engine:
    """How every mode's server is started."""

    model: Path
    served_name: str
    args: tuple[str, ...]
    env: dict[str, str]
    logs: Path


@contextlib.contextmanager
def serving(engine: Engine, mode: Mode, tag: str) -> Iterator[VllmServer]:
    args = list(engine.args)
    if mode.transfer is not None:
        args += ["--kv-transfer-config", json.dumps(mode.transfer)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHARBOR")}
    env.update(engine.env, **mode.env)
    server = VllmServer(engine.model, engine.logs / f"server-{tag}.log", env, name=engine.served_name, args=args)
    try:
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop(signal.SIGTERM)


def failure_reason(log: Path) -> str:
    """The lines of a failed engine's log that say why."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    named = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    return " | ".join((named or lines)[-REASON_LINES:])[:600] or "no output"


@dataclass(frozen=True, slots=True)
class Run:
    """What every mode of one bench run shares."""

    engine: Engine
    workload: Workload
    client: Client
    """The model's name, the bound on a request and the loop (its url is each server's)."""
    restart: bool
    window_s: float


def run_mode(mode: Mode, run: Run) -> dict[str, Any]:
    """Every request of the workload through ``mode``'s engine (restarted half-way with
    ``run.restart``); the mode's figures, or its error."""
    engine, workload, client, restart = run.engine, run.workload, run.client, run.restart
    indices = list(range(len(workload.requests)))
    phases = [indices[: len(indices) // 2], indices[len(indices) // 2 :]] if restart else [indices]
    outcomes: list[Outcome] = []
    counters: dict[str, float] = {}
    tiers: dict[str, dict[str, int]] = {}
    active_s = 0.0
    starts_s: list[float] = []
    for phase, chosen in enumerate(phases):
        tag = f"{mode.name}-{phase}"
        began = time.perf_counter()
        try:
            with serving(engine, mode, tag) as server:
                starts_s.append(round(time.perf_counter() - began, 1))
                before, tiers_before = scrape(server), gateway_tiers(mode.kvharbor_config)
                served = time.perf_counter()
                phase_client = Client(server.url, client.model, client.timeout_s, client.clients, client.salt)
                outcomes += asyncio.run(replay(workload, chosen, phase_client, phase, active_s))
                active_s += time.perf_counter() - served
                added(counters, delta(scrape(server), before))
                for name, counts in tier_delta(gateway_tiers(mode.kvharbor_config), tiers_before).items():
                    tiers.setdefault(name, {})
                    added(tiers[name], counts)  # type: ignore[arg-type]
        except ServerError as err:
            reason = failure_reason(engine.logs / f"server-{tag}.log")
            return {"mode": mode.name, "error": f"engine did not start (phase {phase}): {err}; {reason}"}
    write_outcomes(engine.logs / f"requests-{mode.name}.jsonl", outcomes)
    return figures(mode, run, outcomes, active_s, counters, tiers, starts_s)


def write_outcomes(path: Path, outcomes: Sequence[Outcome]) -> None:
    with path.open("w") as out:
        for outcome in outcomes:
            out.write(json.dumps(outcome.to_json()) + "\n")


def figures(
    mode: Mode,
    run: Run,
    outcomes: Sequence[Outcome],
    active_s: float,
    counters: Mapping[str, float],
    tiers: Mapping[str, Mapping[str, int]],
    starts_s: list[float],
) -> dict[str, Any]:
    workload = run.workload
    result: dict[str, Any] = {"mode": mode.name, "engine_start_s": starts_s, **asdict(summary(outcomes, active_s))}
    gpu = counters.get("vllm:prefix_cache_hits_total", 0.0)
    external = counters.get("vllm:external_prefix_cache_hits_total", 0.0)
    storage = storage_hit_tokens(mode, counters, tiers, workload)
    ram = None if storage is None else external - storage
    prompt = result["prompt_tokens"]
    result["hit_tokens"] = {"gpu": gpu, "ram": ram, "storage": storage, "external": external}
    result["hit_rate_by_source"] = {
        source: (round(value / prompt, 4) if value is not None and prompt else None)
        for source, value in result["hit_tokens"].items()
    }
    result["computed_prompt_tokens"] = prompt - result["cached_tokens"]
    result["accounting"] = {
        "cached_tokens_reported": result["cached_tokens"],
        "engine_hit_tokens": gpu + external,
        "engine_prompt_tokens": counters.get("vllm:prompt_tokens_total", 0.0),
    }
    result["bytes"] = moved_bytes(mode, counters, tiers)
    result["saves_dropped_chunks"] = counters.get("vllm:kvharbor_save_dropped_total")
    result["engine_counters"] = {
        name: value for name, value in counters.items() if name.startswith(ENGINE_COUNTERS) and value
    }
    if mode.name == "kvharbor":
        result["tiers"] = dict(tiers)
    if run.restart:
        result["restart"] = reuse_from_before(workload, outcomes)
    result["windows"] = windows(outcomes, run.window_s)
    return result


def storage_hit_tokens(
    mode: Mode, counters: Mapping[str, float], tiers: Mapping[str, Mapping[str, int]], workload: Workload
) -> float | None:
    """Hit tokens that came from storage, where the mode can tell. kvharbor: its file tier's
    hits, each a chunk read back and promoted into the RAM tier (where the load then finds
    it). vLLM: what it attributes to ``disk`` (``vllm:prompt_tokens_cached_by_source``, in
    the vLLM releases that have it), else the bytes its secondary tier read over the bytes
    it loaded per external hit token."""
    if mode.name == "kvharbor":
        return float(tiers.get("disk", {}).get("hits", 0) * workload.shape.block_tokens)
    if mode.name != "vllm-cpu-fs":
        return 0.0
    disk = counters.get("vllm:prompt_tokens_cached_by_source_total{source=disk}")
    if disk is not None:
        return disk
    loaded = _summed(counters, "vllm:kv_offload_load_bytes")
    external = counters.get("vllm:external_prefix_cache_hits_total", 0.0)
    if not loaded or not external:
        return None
    return _summed(counters, "vllm:kv_offload_tiering_read_bytes") / (loaded / external)


def _summed(counters: Mapping[str, float], prefix: str) -> float:
    return sum(v for k, v in counters.items() if k.startswith(prefix))


def moved_bytes(mode: Mode, counters: Mapping[str, float], tiers: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """Bytes loaded into and stored from the GPU's KV cache, and written to and read from storage."""
    if mode.name == "kvharbor":
        return {
            "loaded": counters.get("vllm:kvharbor_loaded_bytes_total", 0.0),
            "stored": counters.get("vllm:kvharbor_stored_bytes_total", 0.0),
            "storage_written": float(tiers.get("disk", {}).get("put_bytes", 0)),
            "storage_read": float(tiers.get("disk", {}).get("hit_bytes", 0)),
        }
    return {
        "loaded": _summed(counters, "vllm:kv_offload_load_bytes"),
        "stored": _summed(counters, "vllm:kv_offload_store_bytes"),
        "storage_written": _summed(counters, "vllm:kv_offload_tiering_write_bytes"),
        "storage_read": _summed(counters, "vllm:kv_offload_tiering_read_bytes"),
    }


# -- the report ---------------------------------------------------------------------------


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """The modes side by side, one line each."""
    head = (
        f"{'mode':<12} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
        f"{'TPOT p50':>9} {'p99':>7} {'hit gpu':>8} {'ram':>6} {'storage':>7} {'computed':>9} {'loaded GB':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:<12} not run: {r['error'][:200]}")
            continue
        ttft, tpot, share = r["ttft_ms"], r["tpot_ms"], r["hit_rate_by_source"]
        lines.append(
            f"{r['mode']:<12} {r['requests_per_s']:>7.3f} {r['output_tokens_per_s']:>9.1f} "
            f"{_num(ttft['p50']):>9} {_num(ttft['p90']):>8} {_num(ttft['p99']):>8} "
            f"{_num(tpot['p50']):>9} {_num(tpot['p99']):>7} {_num(share['gpu'], 3):>8} {_num(share['ram'], 3):>6} "
            f"{_num(share['storage'], 3):>7} {r['computed_prompt_tokens']:>9} {r['bytes']['loaded'] / 1e9:>9.2f}"
        )
    return "\n".join(lines) + "\n(times in ms; hits as shares of all prompt tokens)"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(results: Sequence[Mapping[str, Any]], logs: Path, path: Path) -> bool:
    """TTFT over the replay's time, per mode; False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(10, 5))
    for r in results:
        if "error" in r:
            continue
        rows = [json.loads(line) for line in (logs / f"requests-{r['mode']}.jsonl").read_text().splitlines()]
        done = [row for row in rows if row["error"] is None and row["ttft_s"] == row["ttft_s"]]
        axes.scatter([row["sent_s"] for row in done], [row["ttft_s"] for row in done], s=6, label=r["mode"])
    axes.set_yscale("log")
    axes.set_xlabel("time since the replay started (s; a restart's downtime left out)")
    axes.set_ylabel("time to first token (s)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def planner_prediction(
    workload: Workload, results: Sequence[Mapping[str, Any]], budget: Budget, out: Path, extra: Sequence[str]
) -> dict[str, Any] | None:
    """``kvharbor plan`` on the scaled slice, with kvharbor's capacity (RAM and file tiers)
    in tokens of its stored chunks; None without a kvharbor result to size them from."""
    measured = next((r for r in results if r["mode"] == "kvharbor" and "error" not in r), None)
    if measured is None or not measured["bytes"]["stored"]:
        return None
    chunks = measured["tiers"].get("ram", {}).get("puts", 0) or 1
    bytes_per_token = measured["tiers"]["ram"]["put_bytes"] / (chunks * workload.shape.block_tokens)
    capacity_tokens = int((budget.cpu_bytes + budget.disk_bytes) / bytes_per_token)
    trace = out / "slice.jsonl"
    command = [
        sys.executable, "-m", "kvharbor", "plan", "--trace", str(trace), "--block-tokens",
        str(workload.shape.block_tokens), "--capacity-tokens", str(capacity_tokens), "--json", *extra,
    ]  # fmt: skip
    answer = subprocess.run(command, capture_output=True, text=True, check=False)
    if answer.returncode != 0:
        return {"error": answer.stderr.strip()[-400:], "command": " ".join(command)}
    predicted = json.loads(answer.stdout)["results"][0]
    return {
        "command": " ".join(command),
        "capacity_tokens": capacity_tokens,
        "bytes_per_token": round(bytes_per_token, 1),
        "predicted_token_hit_rate": predicted["token_hit_rate"],
        "measured_token_hit_rate": measured["hit_rate"],
        "points": round((predicted["token_hit_rate"] - measured["hit_rate"]) * 100, 2),
        "predicted": predicted,
    }


def ratios(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """kvharbor against its peers of the same run."""
    ran = {r["mode"]: r for r in results if "error" not in r}
    found: dict[str, float] = {}
    harbor = ran.get("kvharbor")
    if harbor is None:
        return found
    for peer in ("none", "vllm-cpu", "vllm-cpu-fs"):
        other = ran.get(peer)
        if other is None:
            continue
        key = peer.replace("-", "_")
        if other["requests_per_s"]:
            found[f"requests_per_s_vs_{key}"] = round(harbor["requests_per_s"] / other["requests_per_s"], 4)
        for name, metric, q in (
            ("ttft_p99", "ttft_ms", "p99"),
            ("ttft_p50", "ttft_ms", "p50"),
            ("tpot_p50", "tpot_ms", "p50"),
        ):
            a, b = harbor[metric][q], other[metric][q]
            if a is not None and b:
                found[f"{name}_vs_{key}"] = round(a / b, 4)
    return found


# -- the command ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", type=Path, default=TRACE, help="Mooncake-format JSON lines (default: the shared trace)"
    )
    parser.add_argument("--start", type=int, default=0, help="first request of the slice (default 0)")
    parser.add_argument("--requests", type=int, default=200, help="requests in the slice (default 200)")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, help="open loop: the slice's arrivals rescaled to this mean rate (req/s)")
    loop.add_argument("--clients", type=int, help="closed loop: this many requests in flight (default 2)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--restart", action="store_true", help="restart each mode's engine half-way")
    parser.add_argument("--model", type=Path, help="the model's directory (default: a tiny Llama built under --out)")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=256,
        help="tokens per trace block once scaled (default 256); kvharbor's chunk",
    )
    parser.add_argument("--max-model-len", type=int, default=4096, help="the engines' context (default 4096)")
    parser.add_argument("--output-scale", type=float, default=1.0, help="answers' lengths times this (default 1)")
    parser.add_argument("--output-tokens-max", type=int, default=16, help="longest answer in tokens (default 16)")
    parser.add_argument(
        "--cpu-gb", type=float, default=4.0, help="host RAM for the offloading tier of every mode (GiB)"
    )
    parser.add_argument("--disk-gb", type=float, default=8.0, help="disk for the storage tier of every mode (GiB)")
    parser.add_argument("--server-args", default="", help="more arguments for every vLLM server (one string)")
    parser.add_argument("--window-s", type=float, default=30.0, help="window of the per-window figures (s)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="bound on one request (s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    parser.add_argument("--plan", action="store_true", help="run kvharbor plan on the slice beside the kvharbor mode")
    parser.add_argument("--plan-args", default="", help="more arguments for kvharbor plan (one string)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "serve")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of figures and ratios")
    args = parser.parse_args(argv)
    if args.rate is None and args.clients is None:
        args.clients = 2
    if args.clients is not None and args.clients < 1:
        parser.error(f"--clients: must be >= 1 (got {args.clients})")
    return args


def engine_settings(args: argparse.Namespace, work: Path) -> Engine:
    import shlex

    from kvharbor.demo.model import build_tiny_model

    model = args.model or build_tiny_model(work / "model", max_position=args.max_model_len)
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TMPDIR": str(tmp),  # vLLM leaves its ZMQ sockets there.
    }
    server_args = ("--enforce-eager", "--max-model-len", str(args.max_model_len), *shlex.split(args.server_args))
    return Engine(Path(model), "model", server_args, env, work)


def vocabulary(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("vocab_size", 4096))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    try:
        names = [name.strip() for name in args.modes.split(",") if name.strip()]
        budget = Budget(int(args.cpu_gb * GIB), int(args.disk_gb * GIB))
        engine = engine_settings(args, out)
        answer_room = args.output_tokens_max
        shape = Shape(
            args.block_tokens,
            args.max_model_len - answer_room,
            args.output_scale,
            args.output_tokens_max,
            vocabulary(engine.model),
        )
        workload = Workload.from_trace(args.trace, shape, args.requests, args.start, args.rate, args.seed)
        modes = [make_mode(name, budget, out / name, args.block_tokens) for name in names]
    except (ReplayError, ValueError) as err:
        print(f"bench/serve.py: {err}", file=sys.stderr)
        return 2
    workload.to_trace(out / "slice.jsonl")
    client = Client("", engine.served_name, args.request_timeout_s, args.clients)
    run = Run(engine, workload, client, args.restart, args.window_s)
    loop = f"{args.clients} clients" if args.clients else f"{args.rate} req/s"
    sent = f"{len(workload.requests)} requests ({workload.prompt_tokens} prompt tokens)"
    print(f"serve: {sent}, {loop}, modes {', '.join(names)}")
    results = []
    for mode in modes:
        result = run_mode(mode, run)
        results.append(result)
        # The next mode gets the disk budget whole: vLLM's fs tier takes no bound (it filled
        # the 64 GiB disk of an H100 machine on 240 requests of an 8B shape, 2026-12-07).
        for stored in ("vllm-fs", "kvharbor-files"):
            shutil.rmtree(out / mode.name / stored, ignore_errors=True)
        print("MODE " + json.dumps(result), flush=True)
    report: dict[str, Any] = {"results": results, "budget": asdict(budget), "argv": sys.argv[1:]}
    if args.plan:
        report["plan"] = planner_prediction(workload, results, budget, out, __import__("shlex").split(args.plan_args))
    (out / "serve.json").write_text(json.dumps(report, indent=1))
    print(table(results))
    plot(results, out, out / "ttft.png")
    if report.get("plan"):
        print("plan: " + json.dumps({k: v for k, v in report["plan"].items() if k != "predicted"}))
    flat = {
        f"{r['mode']}_{k}": v for r in results if "error" not in r for k, v in r.items() if isinstance(v, (int, float))
    }
    if not flat:
        print("serve: no mode ran; each one's reason is above", file=sys.stderr)
        return 1
    emit(flat, ratios(results), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
