"""kvharbor on one GPU: the data path against pinned cudaMemcpy, and time to first token.

Run on the H200 (CI has no GPU; nothing here asserts on time). Parts, each
writing ``<part>.json`` into ``--out`` (default ``$OUT`` or ``bench-out``):

  python bench/gpu.py raw                 # (a) offload/restore of paged blocks <-> pinned shm,
                                          #     beside a pinned cudaMemcpy of the same bytes
  python bench/gpu.py gateway             # (a') the same through a real gateway and its RAM tier
  python bench/gpu.py e2e --model DIR     # (b) TTFT at 32,768 and 130,000 tokens after the GPU
                                          #     prefix cache is reset: kvharbor (RAM tier) vs
                                          #     recompute vs vLLM's OffloadingConnector (CPU tier),
                                          #     plus a deliberately slow tier (load-or-recompute)
  python bench/gpu.py restart --model DIR # (c) TTFT of a freshly started engine for prompts the previous
                                          #     engine process stored, with a service-mode gateway and with
                                          #     the default embedded one lingering, beside recompute in a
                                          #     fresh process; with a step-by-step breakdown of one restore
  python bench/gpu.py sigint --model DIR  # (d) vLLM's default shutdown: an engine process answers a prompt
                                          #     and ends at once; how much of the prompt the next process
                                          #     restores, with and without engine.saves_land_before_answer,
                                          #     and the cold TTFT of each
  python bench/gpu.py report --json       # merge the parts; the last line is one JSON object

``--tp N`` (default 1) runs every engine with ``tensor_parallel_size`` N, one GPU per rank,
and the raw part on N GPUs at once (one process per GPU, each repetition started together
on all of them: the ranks share the host's memory bandwidth), with the aggregate beside N
concurrent pinned memcpys. On the CPU smoke test (``KVH_BENCH_DEVICE=cpu``) give vLLM one
core per rank and a small KV cache: ``VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_CPU_KVCACHE_SPACE=1``.

Layout: Llama-3.1-8B (32 layers, 8 KV heads, head size 128, bf16), flash-attn
pages of 16 tokens in NHD memory order, 256-token chunks (32 MiB each).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # The data path's part runs without vLLM: its metadata are stood in for.
    from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS, KV_HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 16, 256
PER_CHUNK = CHUNK // BLOCK
LENGTHS = (32768, 130000)
GIB = 1 << 30
DEVICE = os.environ.get("KVH_BENCH_DEVICE", "cuda")
"""``cpu`` runs the same code on the CPU: a smoke test of the bench itself, not a measurement."""

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 32,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def out_dir(args: argparse.Namespace) -> Path:
    path = Path(args.out or os.environ.get("OUT") or "bench-out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(args: argparse.Namespace, part: str, result: dict[str, Any]) -> None:
    (out_dir(args) / f"{part}.json").write_text(json.dumps(result, indent=1))
    print(f"[{part}] {json.dumps(result)}", flush=True)


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_s(fn: Any, repeat: int, together: Any = None) -> tuple[float, list[float]]:
    """Median seconds of ``repeat`` runs of ``fn``; with ``together`` (a barrier of the
    ranks' processes) each run starts when every rank's does."""
    times = []
    for _ in range(repeat):
        sync()
        if together is not None:
            together.wait()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (cpu smoke test)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    with contextlib.suppress(Exception):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["driver"] = smi.stdout.strip()
    with contextlib.suppress(Exception):
        stat = os.statvfs("/dev/shm")
        info["dev_shm_gib"] = round(stat.f_blocks * stat.f_frsize / GIB, 1)
    with contextlib.suppress(Exception):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    with contextlib.suppress(Exception):
        import vllm

        info["vllm"] = vllm.__version__
    return info


def kv_tensors(blocks: int) -> list[Any]:
    """Per layer, flash-attn's logical (blocks, kv_heads, block, 2*head) over NHD memory."""
    import torch

    layers = []
    for _ in range(LAYERS):
        raw = torch.empty((blocks, BLOCK, KV_HEADS, 2 * HEAD), dtype=torch.bfloat16, device=DEVICE)
        raw.normal_()
        layers.append(raw.permute(0, 2, 1, 3))
    return layers


# -- (a) the raw data path ----------------------------------------------------------


def bench_raw(args: argparse.Namespace) -> None:
    """(a) on one GPU, or with ``--tp N`` on N at once (`raw_rank`), merged into ``raw.json``."""
    if args.tp == 1:
        save(args, "raw", raw_path(args))
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    together = context.Barrier(args.tp)
    ranks = [context.Process(target=raw_rank, args=(args, rank, together)) for rank in range(args.tp)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise SystemExit(f"bench: a rank of the raw part failed: exit codes {[p.exitcode for p in ranks]}")
    per_rank = [json.loads((out_dir(args) / f"raw-rank{rank}.json").read_text()) for rank in range(args.tp)]
    save(args, "raw", merge_ranks(per_rank))


def raw_rank(args: argparse.Namespace, rank: int, together: Any) -> None:
    """One rank of ``raw --tp N``: its own GPU, each timed run started with the other ranks'."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # Before torch: this process sees its GPU as cuda:0.
    (out_dir(args) / f"raw-rank{rank}.json").write_text(json.dumps(raw_path(args, together)))


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' raw figures, and the aggregate: every rank's bytes over the slowest rank's
    median, for kvharbor's copies and for the pinned memcpys all ranks ran at the same time."""
    total = sum(r["bytes"] for r in per_rank)

    def aggregate_gbps(key: str) -> float:
        return round(total / max(r["bytes"] / (r[key] * 1e9) for r in per_rank) / 1e9, 2)

    merged: dict[str, Any] = {"machine": per_rank[0]["machine"], "tp": len(per_rank), "bytes": total, "ranks": per_rank}
    for name in ("restore", "offload", "pinned_memcpy_h2d", "pinned_memcpy_d2h"):
        merged[f"aggregate_{name}_GBps"] = aggregate_gbps(f"{name}_GBps")
    merged["aggregate_restore_vs_pinned_memcpys"] = round(
        merged["aggregate_restore_GBps"] / merged["aggregate_pinned_memcpy_h2d_GBps"], 3
    )
    merged["aggregate_offload_vs_pinned_memcpys"] = round(
        merged["aggregate_offload_GBps"] / merged["aggregate_pinned_memcpy_d2h_GBps"], 3
    )
    merged["restore_vs_pinned_memcpy"] = min(r["restore_vs_pinned_memcpy"] for r in per_rank)
    merged["offload_vs_pinned_memcpy"] = min(r["offload_vs_pinned_memcpy"] for r in per_rank)
    return merged


def raw_path(args: argparse.Namespace, together: Any = None) -> dict[str, Any]:
    """The raw data path on this process's GPU; ``together``: see `median_s`."""
    import torch

    from kvharbor.config import EngineSection
    from kvharbor.connector.vllm.chunks import ChunkPart
    from kvharbor.connector.vllm.device_copy import DeviceCopy
    from kvharbor.connector.vllm.pinning import PinnedMapping, cuda_host_register
    from kvharbor.gateway.shm import Segment

    chunks = args.chunks
    blocks = 2 * chunks * PER_CHUNK + 64
    tensors = kv_tensors(blocks)
    engine = EngineSection()
    pages = DeviceCopy.for_engine(tensors, blocks, PER_CHUNK, engine)
    size = pages.chunk_bytes
    total = chunks * size
    perm = torch.randperm(blocks - 1)[: 2 * chunks * PER_CHUNK].add_(1).tolist()
    src = [perm[c * PER_CHUNK : (c + 1) * PER_CHUNK] for c in range(chunks)]
    dst = [perm[(chunks + c) * PER_CHUNK : (chunks + c + 1) * PER_CHUNK] for c in range(chunks)]
    path = Path(f"/dev/shm/kvh-bench-raw.{os.getpid()}")
    segment = Segment.create(path, total)
    result: dict[str, Any] = {"machine": machine(), "chunks": chunks, "chunk_bytes": size, "bytes": total}
    try:
        started = time.perf_counter()
        pin = PinnedMapping(segment.view, register=None if DEVICE == "cpu" else cuda_host_register)
        result["register_s"] = round(time.perf_counter() - started, 3)
        views = [segment.view[c * size : (c + 1) * size] for c in range(chunks)]
        group = pages.chunks_per_load

        def offload() -> None:
            held = None
            for g in range(0, chunks, group):  # gather group g while group g-1 crosses PCIe
                save = pages.open_save([[ids] for ids in src[g : g + group]], engine.save_staging_wait_ms / 1000)
                assert save is not None
                for layer in range(LAYERS):
                    save.gather_layer(layer)
                save.close()
                for c in range(save.chunks):
                    save.stage(c, pin, views[g + c])
                wait = save.flush(pin)
                if held is not None:
                    held[0].synchronize()
                    held[1].release()
                held = (wait, save)
            if held is not None:
                held[0].synchronize()
                held[1].release()

        def restore() -> None:
            held = None
            pages.begin_loads()
            for g in range(0, chunks, group):
                for c in range(g, min(chunks, g + group)):
                    pages.stage_load(pin, views[c], [ChunkPart(0, dst[c])])
                wait = pages.flush_load(pin)
                if held is not None:
                    held.synchronize()
                held = wait
            if held is not None:
                held.synchronize()
            pages.wait_loads()

        offload()
        restore()
        sync()
        bad = sum(
            not torch.equal(tensors[layer][d], tensors[layer][s])
            for layer in range(0, LAYERS, 7)
            for c in range(chunks)
            for s, d in zip(src[c], dst[c], strict=True)
        )
        result["restore_mismatched_blocks_sampled"] = int(bad)
        offload_s, offload_all = median_s(offload, args.repeat, together)
        restore_s, restore_all = median_s(restore, args.repeat, together)

        host = torch.empty(total, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        device = torch.empty(total, dtype=torch.uint8, device=DEVICE)
        d2h_s, _ = median_s(lambda: host.copy_(device, non_blocking=True), args.repeat, together)
        h2d_s, _ = median_s(lambda: device.copy_(host, non_blocking=True), args.repeat, together)
        shm_d2h_s, _ = median_s(lambda: pin.tensor.copy_(device, non_blocking=True), args.repeat, together)
        shm_h2d_s, _ = median_s(lambda: device.copy_(pin.tensor, non_blocking=True), args.repeat, together)
        pageable = torch.empty(total, dtype=torch.uint8)
        pageable_h2d_s, _ = median_s(lambda: device.copy_(pageable), 2, together)

        def gbps(seconds: float) -> float:
            return round(total / seconds / 1e9, 2)

        result.update(
            offload_GBps=gbps(offload_s),
            restore_GBps=gbps(restore_s),
            pinned_memcpy_d2h_GBps=gbps(d2h_s),
            pinned_memcpy_h2d_GBps=gbps(h2d_s),
            registered_shm_memcpy_d2h_GBps=gbps(shm_d2h_s),
            registered_shm_memcpy_h2d_GBps=gbps(shm_h2d_s),
            pageable_memcpy_h2d_GBps=gbps(pageable_h2d_s),
            offload_s_all=[round(t, 4) for t in offload_all],
            restore_s_all=[round(t, 4) for t in restore_all],
            offload_vs_pinned_memcpy=round(d2h_s / offload_s, 3),
            restore_vs_pinned_memcpy=round(h2d_s / restore_s, 3),
        )
        host = device = pageable = torch.empty(0)  # free 3 x the bytes before the next part
        pin.close()
    finally:
        pages.close()
        segment.view.release()
        with contextlib.suppress(BufferError):
            segment.map.close()
        path.unlink(missing_ok=True)
    return result


# -- (a') through the gateway and its RAM tier ----------------------------------------


def kvharbor_sections(
    socket_dir: Path, shm_name: str, tiers: list[dict[str, Any]], ring_mb: int, **gateway: Any
) -> dict[str, Any]:
    """The kvharbor config every part of this bench runs with (its own socket and segment);
    ``gateway`` adds gateway settings (its mode, say)."""
    return {
        "engine": {"chunk_size": CHUNK},
        "gateway": {
            "socket": str(socket_dir / "gw.sock"),
            "shm_name": shm_name,
            "ring_mb": ring_mb,
            "request_timeout_ms": 30000,
            "ring_wait_ms": 5000,
            **gateway,
        },
        # No fallback tier: a RAM-only run measures RAM, not a disk written beside it.
        "storage": {"tiers": tiers, "probe": False, "value_mb_max": 64, "fallback_path": None},
    }


def load_sections(sections: dict[str, Any]) -> Any:
    from kvharbor.config import load_config

    return load_config(None, {}, overrides=sections)


def gateway_config(socket_dir: Path, tiers: list[dict[str, Any]], ring_mb: int) -> Any:
    return load_sections(kvharbor_sections(socket_dir, f"kvh-bench-{os.getpid()}", tiers, ring_mb, linger_s=0))


def bench_gateway(args: argparse.Namespace) -> None:
    import torch

    from kvharbor.config import EngineSection
    from kvharbor.connector.link import CacheLink, RankSwitch
    from kvharbor.connector.vllm.datapath import DataPath
    from kvharbor.connector.vllm.device_copy import DeviceCopy
    from kvharbor.connector.vllm.pinning import cuda_host_register
    from kvharbor.gateway.client import GatewayClient

    chunks = args.chunks
    blocks = 2 * chunks * PER_CHUNK + 64
    tensors = kv_tensors(blocks)
    engine = EngineSection()  # The data path's defaults: what an engine runs with.
    pages = DeviceCopy.for_engine(tensors, blocks, PER_CHUNK, engine)
    size = pages.chunk_bytes
    work = Path(f"/tmp/kvh-bench-gw-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    ram_gb = chunks * size / GIB * 1.2 + 1
    config = gateway_config(work, [{"name": "ram", "type": "ram", "capacity_gb": ram_gb}], args.ring_mb)
    switch = RankSwitch()
    counts: dict[str, float] = {}

    def count(**deltas: float) -> None:
        for k, v in deltas.items():
            counts[k] = counts.get(k, 0) + v

    load_link, save_link = (
        CacheLink(config, "bench load", switch=switch),
        CacheLink(config, "bench save", switch=switch),
    )
    register = None if DEVICE == "cpu" else cuda_host_register
    names = [str(i) for i in range(LAYERS)]
    path = DataPath(pages, names, load_link, save_link, 0, b"B" * 16, count, engine, register=register)
    result: dict[str, Any] = {"machine": machine(), "chunks": chunks, "bytes": chunks * size, "ring_mb": args.ring_mb}
    try:
        started = time.perf_counter()
        assert path.map(), "pinning failed"
        result["pin_both_mappings_s"] = round(time.perf_counter() - started, 3)
        perm = torch.randperm(blocks - 1)[: 2 * chunks * PER_CHUNK].add_(1).tolist()
        keys = [os.urandom(16) for _ in range(chunks)]
        step = 64  # chunks saved per engine step (16,384 tokens)
        sync()
        t0 = time.perf_counter()
        stored = 0
        for g in range(0, chunks, step):
            part = keys[g : g + step]
            transfer = SimpleNamespace(
                request_id="bench",
                keys=[part],
                block_ids=[perm[g * PER_CHUNK : (g + len(part)) * PER_CHUNK]],
                ends_prompt=False,
            )
            meta = cast("KVHarborMetadata", SimpleNamespace(saves=[transfer], loads=[]))
            path.begin_step(meta)
            for layer in range(LAYERS):
                path.save_layer(str(layer))
            parts = path.end_step(meta)
            assert parts is not None
            try:
                stored += save_link.store(path.fingerprint, [(k, size) for k in parts.keys], parts.fill, parts.settle)
            finally:
                parts.done()
        store_s = time.perf_counter() - t0
        result["stored_chunks"] = stored
        result["store_to_ram_tier_GBps"] = round(stored * size / store_s / 1e9, 2)

        def restore(loader: DataPath = path, layered: bool = False) -> float:
            """One restore of every chunk; ``layered``: as an engine's loader thread makes it,
            its last ``engine.load_layered_mb`` copied layer by layer (`DataPath.load`)."""
            transfer = cast(
                "ChunkTransfer",
                SimpleNamespace(
                    keys=[keys],
                    block_ids=[perm[chunks * PER_CHUNK :]],
                    blocks=chunks * PER_CHUNK,
                    skip_blocks=0,
                    recompute_s=(),
                ),
            )
            loader.begin_step(cast("KVHarborMetadata", SimpleNamespace(saves=[], loads=[transfer])))
            loader.begin_loads()
            sync()
            t0 = time.perf_counter()
            answers: list[int] = []
            restored = loader.load(transfer, answered=answers.append if layered else None)
            loader.copy.wait_loads()
            sync()
            assert restored == chunks * PER_CHUNK and answers == ([restored] if layered else []), (restored, answers)
            return time.perf_counter() - t0

        def mismatched() -> int:
            """Sampled restored blocks that differ from the blocks they were saved from."""
            return sum(
                not torch.equal(tensors[layer][perm[chunks * PER_CHUNK + i]], tensors[layer][perm[i]])
                for layer in (0, 31)
                for i in range(0, chunks * PER_CHUNK, 7)
            )

        def restores(loader: DataPath, layered: bool) -> list[float]:
            """``args.repeat`` restores into blocks zeroed first; every one checked."""
            for tensor in tensors:
                tensor[perm[chunks * PER_CHUNK :]] = 0
            times = [restore(loader, layered) for _ in range(args.repeat)]
            result["restore_mismatched_blocks_sampled"] += mismatched()
            return times

        # The same restore with its last requests copied layer by layer: the default window
        # (engine.load_layered_mb), and the widest one (a staging slot per layer).
        widest = EngineSection(load_layered_mb=65536)
        wide = DataPath(
            DeviceCopy.for_engine(tensors, blocks, PER_CHUNK, widest),
            names, load_link, save_link, 0, b"B" * 16, count, widest, register=register,
        )  # fmt: skip
        assert wide.share(path), "no staging for the layered restore"
        result["restore_mismatched_blocks_sampled"] = 0
        for name, loader, setting in (("tail", path, engine), ("widest", wide, widest)):
            times = restores(loader, layered=True)
            result[f"restore_layered_{name}_mb"] = min(setting.load_layered_mb, wide.copy.held_chunks_max * size >> 20)
            result[f"restore_layered_{name}_GBps"] = round(chunks * size / statistics.median(times) / 1e9, 2)
            result[f"restore_layered_{name}_s_all"] = [round(t, 4) for t in times]
        wide.close()
        times = restores(path, layered=False)
        if args.profile:
            from gpu_timeline import profile_request

            trace = out_dir(args) / f"trace-gateway-{chunks}.json.gz"
            _, result["profiled_restore"] = profile_request(restore, trace)
            print(f"[gateway] profiled restore: {json.dumps(result['profiled_restore']['steps_ms'])}", flush=True)
        result["restore_from_ram_tier_GBps"] = round(chunks * size / statistics.median(times) / 1e9, 2)
        result["restore_s_all"] = [round(t, 4) for t in times]
        client = GatewayClient.connect(config.gateway, "bench status")
        result["gateway_status"] = client.status().to_document()
        client.close()
    finally:
        path.close()
        load_link.close()
        save_link.close()
    save(args, "gateway", result)


# -- (b) end to end in vLLM -------------------------------------------------------------


def write_model(directory: Path) -> Path:
    """Llama-3.1-8B's shape (vLLM draws random weights); a tiny Llama for the CPU smoke test."""
    if DEVICE == "cpu":
        from kvharbor.demo.model import build_tiny_model

        return build_tiny_model(directory, max_position=8192)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return directory


def prompt(length: int, seed: int, vocab: int = 120000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(min(1000, vocab // 4), vocab) for _ in range(length)]


def spawn_engine(args: argparse.Namespace, mode: str, tag: str, extra: list[str]) -> int:
    """One engine process (`run_engine`), its output in ``engine-<tag>.log``; its exit code."""
    log = out_dir(args) / f"engine-{tag}.log"
    command = [sys.executable, __file__, "engine", "--mode", mode, "--tag", tag, "--model", str(args.model)]
    command += ["--out", str(out_dir(args)), "--max-model-len", str(args.max_model_len), *extra]
    command += ["--hash-algo", args.hash_algo, "--tp", str(args.tp)]
    started = time.perf_counter()
    with open(log, "w") as sink:
        try:
            code = subprocess.run(
                command, stdout=sink, stderr=subprocess.STDOUT, timeout=args.engine_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    print(f"[engine] {tag}: exit {code} in {time.perf_counter() - started:.0f} s (log {log.name})", flush=True)
    if code:
        print("".join(log.read_text().splitlines(keepends=True)[-30:]), flush=True)
    return code


def bench_e2e(args: argparse.Namespace) -> None:
    """One engine per mode, each in its own process, one after the other."""
    write_model(Path(args.model))
    for mode in args.modes.split(","):
        spawn_engine(args, mode, mode, ["--lengths", args.lengths])


def kvharbor_transfer(sections: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVHarborConnector",
        "kv_connector_module_path": "kvharbor.connector.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": sections,
    }


def engine_transfer(args: argparse.Namespace, work: Path) -> dict[str, Any] | None:
    """The engine's ``kv_transfer_config`` for its mode (None: no connector)."""
    mode = args.mode
    if args.kvharbor:  # The restart roles: the orchestrator's config, shared by both processes.
        return kvharbor_transfer(json.loads(Path(args.kvharbor).read_text()))
    # One engine per mode, each with its own gateway: none outlives its engine (the restart part's does).
    if mode == "kvharbor":
        ram = [{"name": "ram", "type": "ram", "capacity_gb": 24}]
        return kvharbor_transfer(kvharbor_sections(work, f"kvh-e2e-{os.getpid()}", ram, 4096, linger_s=0))
    if mode == "slowtier":
        tier = {"name": "disk", "type": "file", "path": str(work / "tier"), "capacity_gb": 12, "fsync": False}
        return kvharbor_transfer(kvharbor_sections(work, f"kvh-e2e-{os.getpid()}", [tier], 4096, linger_s=0))
    if mode == "native":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 24 * GIB},
        }
    return None


class Engine:
    """One vLLM engine in this process (the connector objects in reach), and what
    every role does with it."""

    def __init__(self, llm: Any, vocab: int) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.vocab = vocab
        self.sampling = SamplingParams(max_tokens=1, temperature=0.0)
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.side = getattr(connector, "_scheduler", None)
        """kvharbor's scheduler half; None for the other connectors."""

    def generate(self, ids: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], self.sampling, use_tqdm=False)[0]
        return {
            "ttft_s": round(time.perf_counter() - t0, 4),
            "cached": out.num_cached_tokens,
            "token": list(out.outputs[0].token_ids),
        }

    def reset(self) -> bool:
        """Empty the GPU prefix cache (the connector's tiers stay); False if vLLM would not.
        vLLM 0.26 refuses while a request whose restore was cut short still holds its blocks
        ("some blocks (2048) are not freed yet", seen right after one): a one-token request
        lets the engine step again, then it is asked again, three times in all."""
        for _ in range(2):
            if self.llm.reset_prefix_cache():
                return True
            self.llm.generate([{"prompt_token_ids": prompt(16, 7, self.vocab)}], self.sampling, use_tqdm=False)
        return bool(self.llm.reset_prefix_cache())

    def chunk_bytes(self) -> int:
        """What one chunk stores: every rank's shard of it."""
        layout = self.side.layout if self.side is not None else None
        if layout is None:
            return 0
        return sum(g.page_bytes * len(g.layer_names) for g in layout.groups) * layout.blocks_per_chunk * layout.ranks

    def gateway_status(self) -> dict[str, Any] | None:
        if self.side is None:
            return None
        return gateway_status(self.side.config.gateway)

    def settle(self, expected_bytes: int) -> float:
        """Wait until the connector's saves have landed (kvharbor: the gateway's count)."""
        t0 = time.perf_counter()
        if self.side is None:
            time.sleep(3.0)  # vLLM's offloading stores behind; its copies run at PCIe speed.
            return time.perf_counter() - t0
        last, still = -1, 0
        while time.perf_counter() - t0 < 300:
            status = self.gateway_status()
            now = int(status["counters"]["put_bytes"]) if status else -1
            if now >= expected_bytes or (now == last and still >= 20):
                break
            still = still + 1 if now == last else 0
            last = now
            time.sleep(0.25)
        return time.perf_counter() - t0


def gateway_status(section: Any) -> dict[str, Any] | None:
    """The status document of the gateway at ``section.socket``; None if none answers."""
    from kvharbor.gateway.client import GatewayClient, GatewayError

    try:
        client = GatewayClient.connect(section, "bench status")
    except GatewayError:
        return None
    try:
        return client.status().to_document()
    finally:
        client.close()


SWITCH_INTERVAL_ENV = "KVH_BENCH_SWITCH_INTERVAL_US"
"""Set: the engine process's `sys.setswitchinterval` in microseconds (Python's default: 5000), to
measure what the loader thread loses waiting for the interpreter while vLLM's thread runs Python."""


def run_engine(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the connector objects are in reach
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    switch_us = os.environ.get(SWITCH_INTERVAL_ENV)
    if switch_us:  # An experiment: how long a thread waiting for the interpreter may wait.
        sys.setswitchinterval(int(switch_us) / 1e6)
    import torch
    from vllm import LLM

    mode = args.mode
    vocab = min(120000, int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]))
    work = Path(f"/tmp/kvh-e2e-{mode}-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype="bfloat16" if DEVICE == "cuda" else "float32",
        max_model_len=args.max_model_len,
        enforce_eager=True,
        gpu_memory_utilization=0.80,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        max_num_seqs=8,
        max_num_batched_tokens=16384,
        seed=0,
        prefix_caching_hash_algo=args.hash_algo,
        kv_transfer_config=engine_transfer(args, work),
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp" if args.tp > 1 else None,
    )
    result: dict[str, Any] = {
        "mode": mode,
        "tp": args.tp,
        "machine": machine(),
        "engine_start_s": round(time.perf_counter() - started, 1),
    }
    engine = Engine(llm, vocab)
    lengths = [int(x) for x in args.lengths.split(",")]
    output = out_dir(args) / f"engine-{args.tag or mode}.json"

    def write() -> None:
        output.write_text(json.dumps(result, indent=1))

    if mode == "answer":
        sigint_role(engine, args, result, write)
    elif mode in ("store", "restore"):
        restart_role(engine, args, lengths, result, write)
    else:
        e2e_role(engine, args, lengths, result, write)
    status = engine.gateway_status()
    if status is not None:
        result["gateway_status"] = status
    if DEVICE == "cuda":
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 1)
    write()
    print(f"[{args.tag or mode}] done", flush=True)
    gc.collect()
    # vLLM's in-process engine can hang at interpreter exit; the results are written. An
    # embedded gateway sees its clients go as at any engine exit (and lingers).
    os._exit(0)


def e2e_role(engine: Engine, args: argparse.Namespace, lengths: list[int], result: dict[str, Any], write: Any) -> None:
    """(b): each prompt cold, then restored after the GPU prefix cache is reset."""
    import kvharbor.cache.bandwidth as bandwidth

    mode, side, vocab = args.mode, engine.side, engine.vocab
    if mode == "slowtier":
        lengths = lengths[:1]

    def drop_page_cache() -> bool:
        try:
            subprocess.run(["sync"], check=True, timeout=120)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return True
        except Exception as err:  # A demo on a box that will not drop caches still runs.
            print(f"drop_caches failed: {err}", flush=True)
            return False

    chunk_bytes = engine.chunk_bytes()
    warm = args.warmup_tokens
    engine.generate(prompt(warm, 999, vocab))  # warm up (kernels, allocator); kvharbor stores its chunks too
    stored_before = warm // CHUNK * chunk_bytes
    for length in lengths:
        ids = prompt(length, length, vocab)
        expected = length // CHUNK * chunk_bytes
        entry: dict[str, Any] = {}
        engine.reset()
        entry["cold"] = engine.generate(ids)
        if mode == "recompute":
            engine.reset()
            entry["cold2"] = engine.generate(ids)
        elif mode in ("kvharbor", "native"):
            entry["settle_s"] = round(engine.settle(stored_before + expected), 2)
            if side is not None:
                bandwidth.SWITCH_MARGIN = 1e9  # measure the restore itself: the planner may not say recompute
            restores = []
            for _ in range(2):
                engine.reset()
                restores.append(engine.generate(ids))
            bandwidth.SWITCH_MARGIN = 1.0
            entry["restores"] = restores
            if side is not None:
                engine.reset()
                # What the load-or-recompute choice does with the rates it measured.
                entry["auto"] = engine.generate(ids)
        elif mode == "slowtier":
            assert side is not None
            entry["settle_s"] = round(engine.settle(stored_before + expected), 2)
            entry["dropped_page_cache"] = drop_page_cache()
            engine.reset()
            entry["first"] = engine.generate(ids)  # no load rate known yet: the worker cuts the load short
            entry["planner_after_first"] = side.planner.snapshot() if side.planner else None
            entry["dropped_page_cache_2"] = drop_page_cache()
            entry["reset_before_second"] = engine.reset()
            entry["second"] = engine.generate(ids)  # the measured disk rate: recompute, not load
            entry["dropped_page_cache_3"] = drop_page_cache()
            entry["reset_before_third"] = engine.reset()
            entry["third"] = engine.generate(ids)
        stored_before += expected
        if side is not None and side.planner is not None:
            entry["planner"] = side.planner.snapshot()
        result[str(length)] = entry
        print(f"[{mode}] {length}: {json.dumps(entry)}", flush=True)
        write()


# -- (c) a restarted engine ---------------------------------------------------------------


def restart_role(
    engine: Engine, args: argparse.Namespace, lengths: list[int], result: dict[str, Any], write: Any
) -> None:
    """``store``: compute and store the prompts, wait until the gateway holds them, exit.
    ``restore`` (the next process): each prompt once, as the first requests after its start
    (after a warm-up shorter than one chunk, which kvharbor neither looks up nor stores);
    with ``--extras`` then, for the longest prompt, vLLM's own floor and the breakdown."""
    from gpu_timeline import clock_request, profile_request

    vocab = engine.vocab
    engine.generate(prompt(args.warmup_tokens, 999, vocab))
    if args.mode == "store":
        for length in lengths:
            result[str(length)] = {"cold": engine.generate(prompt(length, length, vocab))}
            write()
        chunks = sum(length // CHUNK for length in lengths) + args.warmup_tokens // CHUNK
        result["settle_s"] = round(engine.settle(chunks * engine.chunk_bytes()), 2)
        return
    for length in lengths:
        ids = prompt(length, length, vocab)
        entry = result[str(length)] = {}
        entry["restart"], entry["restart_clock"] = clock_request(functools.partial(engine.generate, ids))
        print(f"[{args.tag}] {length}: {json.dumps(entry['restart'])} {entry['restart_clock']['steps_ms']}", flush=True)
        write()
    if not args.extras:
        return
    length = max(lengths)
    ids = prompt(length, length, vocab)
    entry = result[str(length)]
    # vLLM's own floor: the same prefix from its GPU prefix cache, the same uncached tail
    # computed (one chunk's forward, and all vLLM does per request at this length).
    hit = (length - 1) // CHUNK * CHUNK
    tail = ids[:hit] + prompt(length - hit, length + 1, vocab)
    entry["local_tail"], entry["local_tail_clock"] = clock_request(lambda: engine.generate(tail))
    warm = []
    for _ in range(2):
        engine.reset()
        warm.append(engine.generate(ids))
    entry["warm_restores"] = warm
    engine.reset()
    entry["clocked"], entry["clock"] = clock_request(lambda: engine.generate(ids))
    engine.reset()
    trace = out_dir(args) / f"trace-{args.tag}-{length}.json.gz"
    entry["profiled"], entry["breakdown"] = profile_request(lambda: engine.generate(ids), trace)
    for name in ("local_tail_clock", "clock", "breakdown"):
        print(f"[{args.tag}] {length} {name}: {json.dumps(entry[name]['steps_ms'])}", flush=True)
    print(f"[{args.tag}] {length} breakdown dma_gaps: {json.dumps(entry['breakdown'].get('dma_gaps'))}", flush=True)
    floor = pcie_floor(entry, engine.chunk_bytes())
    if floor is not None:
        entry["pcie_floor"] = floor
        print(f"[{args.tag}] {length} pcie_floor: {json.dumps(floor)}", flush=True)
    write()


FLOOR_COPY_BYTES = 1 << 30
"""One pinned host-to-GPU copy of the floor's rate measurement (`pcie_floor`)."""


def pcie_floor(entry: dict[str, Any], chunk_bytes: int, repeat: int = 5) -> dict[str, Any] | None:
    """`floor_figures` of ``entry`` with the pinned host-to-GPU copy rate measured now, in the
    restoring engine's process (median of ``repeat`` copies of `FLOOR_COPY_BYTES`); None off a
    GPU, or without the figures the floor needs."""
    import torch

    tail_ms = entry.get("local_tail_clock", {}).get("after_load_gpu_ms")
    if DEVICE != "cuda" or not torch.cuda.is_available() or tail_ms is None or not chunk_bytes:
        return None
    host = torch.empty(FLOOR_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(FLOOR_COPY_BYTES, dtype=torch.uint8, device="cuda")
    seconds, _ = median_s(lambda: device.copy_(host, non_blocking=True), repeat)
    return floor_figures(entry, chunk_bytes, FLOOR_COPY_BYTES / seconds / 1e9)


def floor_figures(entry: dict[str, Any], chunk_bytes: int, rate_GBps: float) -> dict[str, Any]:
    """The floor a restore is held against (issue 9): its KV bytes over the pinned host-to-GPU
    copy rate, plus the GPU time of the tail vLLM computes after the restored prefix
    (``local_tail_clock``: the same prefix from vLLM's own GPU cache, from the end of the load
    to the end of sampling); and each timed restore of ``entry`` against it."""
    restored_bytes = entry["restart"]["cached"] // CHUNK * chunk_bytes
    tail_ms = entry["local_tail_clock"]["after_load_gpu_ms"]
    floor_ms = restored_bytes / rate_GBps / 1e6 + tail_ms
    restores_ms = {
        "restart": entry["restart"]["ttft_s"] * 1000,
        **{f"warm{i}": warm["ttft_s"] * 1000 for i, warm in enumerate(entry["warm_restores"], 1)},
        "clocked": entry["clocked"]["ttft_s"] * 1000,
        "profiled": entry["profiled"]["ttft_s"] * 1000,
    }
    return {
        "pinned_h2d_GBps": round(rate_GBps, 2),
        "restored_bytes": restored_bytes,
        "tail_gpu_ms": tail_ms,
        "floor_ms": round(floor_ms, 1),
        "vs_floor": {name: round(ms / floor_ms, 3) for name, ms in restores_ms.items()},
    }


RESTART_RING_MB = 1024
"""The restart part's ring: GPU puts and RAM-tier hits go in place, not through it, and every
engine start page-locks the whole segment (ring included) twice."""
RESTART_WARMUP_TOKENS = 64
"""Shorter than one chunk: warms vLLM (kernels, allocator) in every process; kvharbor neither
looks it up nor stores it, so a restarted engine's first restore is the timed one."""


class Gateway:
    """The gateway one phase of the restart part runs against.

    service: a ``kvharbor gateway`` process started here and stopped at the end;
    embedded: the one the first engine starts, which must outlive that engine
    (``gateway.linger_s``); stopped at the end, once the second engine is done.
    """

    def __init__(self, args: argparse.Namespace, mode: str, sections: dict[str, Any], config_path: Path) -> None:
        self.mode = mode
        self.section = load_sections(sections).gateway
        self.process: subprocess.Popen[bytes] | None = None
        if mode == "service":
            log = open(out_dir(args) / "gateway-service.log", "wb")  # noqa: SIM115 - the process's life
            command = [sys.executable, "-m", "kvharbor", "gateway", "--config", str(config_path), "--start-clean=1"]
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            self.wait_serving(180)

    def wait_serving(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = gateway_status(self.section)
            if status is not None:
                return status
            if self.process is not None and self.process.poll() is not None:
                raise SystemExit(f"bench: the {self.mode} gateway exited with {self.process.returncode}")
            time.sleep(0.2)
        raise SystemExit(f"bench: no {self.mode} gateway answered at {self.section.socket} in {timeout_s:.0f} s")

    def stop(self) -> None:
        status = gateway_status(self.section)
        pid = self.process.pid if self.process is not None else (status or {}).get("pid")
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)
        if self.process is not None:
            self.process.wait(timeout=120)
            return
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def bench_restart(args: argparse.Namespace) -> None:
    """(c): TTFT of a freshly started engine for prompts the previous process stored."""
    write_model(Path(args.model))
    lengths = ",".join(str(n) for n in sorted((int(x) for x in args.lengths.split(",")), reverse=True))
    work = Path(f"/tmp/kvh-restart-{os.getpid()}")
    tiers = [{"name": "ram", "type": "ram", "capacity_gb": args.ram_gb}]
    result: dict[str, Any] = {"lengths": lengths, "ram_gb": args.ram_gb, "ring_mb": RESTART_RING_MB, "phases": {}}
    phases = result["phases"]
    common = ["--lengths", lengths, "--warmup-tokens", str(RESTART_WARMUP_TOKENS)]
    chosen = args.phases.split(",")
    if "recompute" in chosen:
        phases["recompute"] = {"exit": spawn_engine(args, "recompute", "restart-recompute", common)}
    for mode in (m for m in chosen if m != "recompute"):
        started = time.perf_counter()
        (work / mode).mkdir(parents=True, exist_ok=True)
        gateway = {"mode": "service"} if mode == "service" else {}  # embedded: the defaults (it lingers)
        sections = kvharbor_sections(
            work / mode, f"kvh-restart-{mode}-{os.getpid()}", tiers, RESTART_RING_MB, **gateway
        )
        config_path = work / mode / "kvharbor.yaml"
        config_path.write_text(json.dumps(sections))  # JSON is YAML
        phase: dict[str, Any] = {}
        phases[mode] = phase
        server = Gateway(args, mode, sections, config_path)
        try:
            extra = [*common, "--kvharbor", str(config_path)]
            phase["store_exit"] = spawn_engine(args, "store", f"restart-{mode}-store", extra)
            status = gateway_status(server.section)  # embedded: alive only if it outlived its engine
            phase["gateway_after_store"] = None if status is None else {
                k: status.get(k) for k in ("pid", "clients", "store")
            }  # fmt: skip
            extras = ["--extras"] if mode == args.extras_for else []
            phase["restore_exit"] = spawn_engine(args, "restore", f"restart-{mode}-restore", [*extra, *extras])
        finally:
            server.stop()
        detached_log = Path(server.section.socket + ".log")  # An embedded gateway's own log (it outlives engines).
        if detached_log.exists():
            (out_dir(args) / f"gateway-{mode}.log").write_bytes(detached_log.read_bytes())
        phase["wall_s"] = round(time.perf_counter() - started, 1)
    save(args, "restart", result)


# -- the report --------------------------------------------------------------------


def report(args: argparse.Namespace) -> None:
    d = out_dir(args)

    def load(name: str) -> dict[str, Any]:
        path = d / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    raw, gw = load("raw"), load("gateway")
    engines = {m: load(f"engine-{m}") for m in ("recompute", "kvharbor", "native", "slowtier")}
    ttft: dict[str, dict[str, float | None]] = {}
    for length in LENGTHS:
        key = str(length)
        rec = engines["recompute"].get(key, {})
        kvh = engines["kvharbor"].get(key, {})
        nat = engines["native"].get(key, {})
        ttft[key] = {
            "recompute_s": best_cold(rec),
            "kvharbor_restore_s": min((x["ttft_s"] for x in kvh.get("restores", [])), default=None),
            "kvharbor_auto_s": kvh.get("auto", {}).get("ttft_s"),
            "vllm_native_s": min((x["ttft_s"] for x in nat.get("restores", [])), default=None),
            "kvharbor_cached_tokens": max((x["cached"] for x in kvh.get("restores", [])), default=None),
            "first_token_matches_recompute": (
                kvh["restores"][0]["token"] == rec["cold"]["token"] if kvh.get("restores") and rec.get("cold") else None
            ),
            "native_cached_tokens": max((x["cached"] for x in nat.get("restores", [])), default=None),
        }

    t32, t130 = ttft["32768"], ttft["130000"]
    slow = engines["slowtier"].get("32768", {})
    restart = restart_figures(load)
    summary = {
        "benchmark": "bench/gpu.py",
        "date": time.strftime("%Y-%m-%d"),
        "machine": raw.get("machine") or engines["kvharbor"].get("machine") or restart.get("machine"),
        "tp": args.tp,
        "raw": {k: v for k, v in raw.items() if k != "machine"},
        "gateway": {k: v for k, v in gw.items() if k not in ("machine", "gateway_status")},
        "ttft": ttft,
        "restart": restart,
        "slow_tier": {
            "first_ttft_s": slow.get("first", {}).get("ttft_s"),
            "second_ttft_s": slow.get("second", {}).get("ttft_s"),
            "dropped_page_cache": slow.get("dropped_page_cache"),
            "planner": slow.get("planner"),
        },
        "ratios": {
            "offload_vs_pinned_memcpy": raw.get("offload_vs_pinned_memcpy"),
            "restore_vs_pinned_memcpy": raw.get("restore_vs_pinned_memcpy"),
            "aggregate_restore_vs_pinned_memcpys": raw.get("aggregate_restore_vs_pinned_memcpys"),
            "ttft_restore_vs_recompute_32k": ratio(t32["kvharbor_restore_s"], t32["recompute_s"]),
            "ttft_restore_vs_recompute_130k": ratio(t130["kvharbor_restore_s"], t130["recompute_s"]),
            "ttft_vs_vllm_native_130k": ratio(t130["kvharbor_restore_s"], t130["vllm_native_s"]),
            **restart.pop("ratios"),
        },
    }
    (d / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.json:
        print(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def best_cold(entry: dict[str, Any]) -> float | None:
    """A recompute's figure: the better of its two cold prefills (the first is a fresh
    process's, the second has every kernel warm)."""
    times = [x["ttft_s"] for x in (entry.get("cold"), entry.get("cold2")) if x]
    return min(times) if times else None


def restart_figures(load: Any) -> dict[str, Any]:
    """(c) in the report: per gateway mode and length, the restarted engine's TTFT beside
    recompute; the ratios ``ttft_restart_vs_recompute_<32k|130k>_<service|embedded>``."""
    recompute = load("engine-restart-recompute")
    figures: dict[str, Any] = {"machine": recompute.get("machine"), "ratios": {}}
    lengths = sorted(int(n) for n in load("restart").get("lengths", "").split(",") if n)
    for mode in ("service", "embedded"):
        restored = load(f"engine-restart-{mode}-restore")
        for length in lengths:
            label = f"{length // 1000}k"  # 32768 -> 32k, 130000 -> 130k
            rec, got = recompute.get(str(length), {}), restored.get(str(length), {})
            first = got.get("restart")
            cold = best_cold(rec)
            entry: dict[str, Any] = {
                "recompute_s": cold,
                "restart_ttft_s": first and first["ttft_s"],
                "restart_cached_tokens": first and first["cached"],
                "first_token_matches_recompute": (first["token"] == rec["cold"]["token"]) if first and rec else None,
            }
            if "local_tail" in got:
                entry["vllm_gpu_hit_same_tail_s"] = got["local_tail"]["ttft_s"]
                entry["warm_restore_s"] = min(x["ttft_s"] for x in got["warm_restores"])
                for name, part in (("clocked_restore", "clock"), ("clocked_gpu_hit", "local_tail_clock")):
                    entry[f"{name}_steps_ms"] = got.get(part, {}).get("steps_ms")
                entry["profiled_restore_steps_ms"] = got.get("breakdown", {}).get("steps_ms")
            figures[f"{label}_{mode}"] = entry
            figures["ratios"][f"ttft_restart_vs_recompute_{label}_{mode}"] = ratio(entry["restart_ttft_s"], cold)
            floor = got.get("pcie_floor")
            if floor is not None:  # The restarted engine's first request, and the best of its later restores.
                entry["pcie_floor"] = floor
                later = [v for name, v in floor["vs_floor"].items() if name != "restart"]
                figures["ratios"][f"restart_vs_pcie_floor_{label}_{mode}"] = floor["vs_floor"]["restart"]
                figures["ratios"][f"restore_vs_pcie_floor_{label}_{mode}"] = min(later)
    return figures


def chunk_bound(length: int) -> int:
    """The tokens a restore of a fully stored prompt gives back: whole chunks, and never the
    last token (vLLM computes it)."""
    from kvharbor.cache.keys import max_hit_tokens

    return min(max_hit_tokens(length, CHUNK), max_hit_tokens(length - 1, BLOCK))


def sigint_role(engine: Engine, args: argparse.Namespace, result: dict[str, Any], write: Any) -> None:
    """``answer``: first the prompt of ``--check`` tokens (0: none), which the previous
    process answered: what this one restores of it; then each of ``--lengths`` (0: none),
    cold. Right after the last answer the process ends at once (`os._exit`), engine and
    saver thread with it, as vLLM's default shutdown (``--shutdown-timeout 0``) kills an
    engine right after it answered."""
    vocab = engine.vocab
    engine.generate(prompt(args.warmup_tokens, 999, vocab))  # Warms vLLM; shorter than a chunk.
    if args.check:
        restored = engine.generate(prompt(args.check, args.check, vocab))
        result["check"] = {"length": args.check, "bound": chunk_bound(args.check), **restored}
        print(f"[{args.tag}] restored {restored['cached']} of {args.check} (bound {chunk_bound(args.check)})")
    for length in (n for n in map(int, args.lengths.split(",")) if n > 0):
        result[str(length)] = {"cold": engine.generate(prompt(length, length, vocab))}
    write()
    sys.stdout.flush()
    os._exit(0)


def bench_sigint(args: argparse.Namespace) -> None:
    """(d): per length, an engine process answers the prompt and ends at once (`sigint_role`);
    the next process answers it again. Each mode (``engine.saves_land_before_answer`` off,
    then on) runs its processes against the default embedded gateway, which outlives them."""
    write_model(Path(args.model))
    lengths = sorted(int(x) for x in args.lengths.split(","))
    result: dict[str, Any] = {"lengths": lengths, "ram_gb": args.ram_gb}
    for land in (False, True):
        tag = f"land-{int(land)}"
        work = Path(f"/tmp/kvh-sigint-{os.getpid()}-{tag}")
        work.mkdir(parents=True, exist_ok=True)
        tiers = [{"name": "ram", "type": "ram", "capacity_gb": args.ram_gb}]
        sections = kvharbor_sections(work, f"kvh-sigint-{os.getpid()}-{tag}", tiers, RESTART_RING_MB)
        sections["engine"]["saves_land_before_answer"] = land
        config_path = work / "kvharbor.yaml"
        config_path.write_text(json.dumps(sections))  # JSON is YAML
        runs: dict[str, Any] = {}
        result[tag] = runs
        steps = list(zip([0, *lengths], [*lengths, 0], strict=True))
        try:
            for number, (check, answer) in enumerate(steps):
                name = f"sigint-{tag}-{number}"
                extra = ["--kvharbor", str(config_path), "--check", str(check), "--lengths", str(answer)]
                code = spawn_engine(args, "answer", name, [*extra, "--warmup-tokens", str(RESTART_WARMUP_TOKENS)])
                if code != 0:
                    raise SystemExit(f"bench: engine {name} exited with {code}: {out_dir(args)}/engine-{name}.log")
                done = json.loads((out_dir(args) / f"engine-{name}.json").read_text())
                if check:
                    cold = runs[str(check)]
                    cold.update(
                        restored_tokens=done["check"]["cached"],
                        bound_tokens=done["check"]["bound"],
                        restart_ttft_s=done["check"]["ttft_s"],
                        same_token=done["check"]["token"] == cold.pop("cold_token"),
                    )
                if answer:
                    first = done[str(answer)]["cold"]
                    runs[str(answer)] = {"cold_ttft_s": first["ttft_s"], "cold_token": first["token"]}
        finally:
            Gateway(args, "embedded", sections, config_path).stop()  # The one the first process started.
    for length in map(str, lengths):
        off, on = result["land-0"].get(length, {}), result["land-1"].get(length, {})
        if "restored_tokens" in off and "restored_tokens" in on:
            result[f"restored_vs_bound_{length}_off"] = round(off["restored_tokens"] / off["bound_tokens"], 3)
            result[f"restored_vs_bound_{length}_on"] = round(on["restored_tokens"] / on["bound_tokens"], 3)
            result[f"cold_ttft_on_vs_off_{length}"] = round(on["cold_ttft_s"] / off["cold_ttft_s"], 3)
    save(args, "sigint", result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["raw", "gateway", "e2e", "restart", "sigint", "engine", "report"])
    parser.add_argument("--out")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine; raw: GPUs at once")
    parser.add_argument("--json", action="store_true", help="report: print only the one-line JSON")
    parser.add_argument("--chunks", type=int, default=128, help="raw/gateway: chunks moved (32 MiB each)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ring-mb", type=int, default=6144)
    parser.add_argument("--profile", action="store_true", help="gateway: profile one more restore (steps, DMA)")
    parser.add_argument("--model", default="/tmp/kvh-llama31-8b")
    parser.add_argument("--modes", default="recompute,kvharbor,native,slowtier")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--engine-timeout", type=int, default=900)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--warmup-tokens", type=int, default=2048, help="engine: the warm-up prompt's length")
    parser.add_argument("--ram-gb", type=float, default=22.0, help="restart: the RAM tier's capacity")
    parser.add_argument(
        "--hash-algo",
        default="sha256",
        help="vLLM's --prefix-caching-hash-algo in every engine (its block hashing is part of each restore)",
    )
    parser.add_argument(
        "--phases", default="recompute,service,embedded", help="restart: recompute and the gateway modes, in order"
    )
    parser.add_argument("--extras-for", default="service", help="restart: the mode whose restore adds the breakdown")
    # The engine part's own (the parts above start it).
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--kvharbor", help=argparse.SUPPRESS)
    parser.add_argument("--extras", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--check", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tp < 1:
        parser.error(f"--tp must be >= 1 (got {args.tp})")
    parts = {"raw": bench_raw, "gateway": bench_gateway, "e2e": bench_e2e, "restart": bench_restart}
    parts["sigint"] = bench_sigint
    parts.update(engine=run_engine, report=report)
    parts[args.part](args)


if __name__ == "__main__":
    main()
