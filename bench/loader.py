"""The loader thread's own time per load request, against the copy it feeds.

A restore's loader thread stages each gateway answer and launches its copies and
scatters (`DeviceCopy.stage_load`, `DeviceCopy.flush_load`). While vLLM's thread
prepares a step it holds the interpreter and the loader stops, so the copies queued
before must last: how fast the loader queues requests, against how fast the copy
engine empties them, decides how far ahead of the copies it can get in the time the
engine's thread waits for it (`engine.load_start_wait_ms`, `docs/performance.md`).

On a GPU, `DeviceCopy` runs over a model's real KV shape (``--layers`` layers of
``--blocks-per-chunk`` blocks of ``--page-kib`` KiB per chunk, ``--chunks``
chunks per request: Llama-3.1-8B's 32 layers, 16-token blocks of 64 KiB and 256 MiB
requests by default) from page-locked memory, and each request's host-to-device copy
is timed alone with CUDA events. On the CPU (``KVH_BENCH_DEVICE=cpu`` or no GPU) the
pages are 256 B: the copies would dominate and there is no copy engine to compare
against, so only the loader's own (Python and dispatch) time is measured.

    .venv/bin/python bench/loader.py [--requests 200] [--json]

With ``--json`` the last line is ``{"figures": {...}, "ratios": {...}}``:
``loader_vs_dma`` below 1 means the loader outpaces the copies, by ``1 - ratio`` of a
request's copy time per request queued. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvharbor.connector.vllm.chunks import ChunkPart
from kvharbor.connector.vllm.device_copy import DeviceCopy
from kvharbor.connector.vllm.pinning import PinnedMapping, cuda_host_register

CPU_PAGE_BYTES = 256
"""A page on the CPU: small enough that the copies cost next to nothing beside the calls."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    parser.add_argument("--page-kib", type=int, default=64, help="bytes of one block of one layer (GPU)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per load request")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and os.environ.get("KVH_BENCH_DEVICE") != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    page_bytes = args.page_kib << 10 if cuda else CPU_PAGE_BYTES
    per, chunks = args.blocks_per_chunk, args.chunks
    num_blocks = 4 * chunks * per  # Four requests' worth of blocks: each request lands elsewhere.
    tensors = [
        torch.zeros(num_blocks, page_bytes // 2, dtype=torch.bfloat16, device=device) for _ in range(args.layers)
    ]
    chunk_bytes = args.layers * per * page_bytes
    copy = DeviceCopy(tensors, num_blocks, per, chunks * chunk_bytes, chunk_bytes, None, 2, 4 << 20)
    source = mmap.mmap(-1, 2 * chunks * chunk_bytes)  # Two requests' answers, used in turn.
    mapping = PinnedMapping(memoryview(source), register=cuda_host_register if cuda else None)
    view = memoryview(source)
    copy.reserve_loads()

    def request(k: int) -> float:
        """One request's loader time: its chunks staged, its copies and scatters launched."""
        copy.begin_loads()
        started = time.perf_counter()
        for c in range(chunks):
            at = ((k % 2) * chunks + c) * chunk_bytes
            first = ((k % 4) * chunks + c) * per
            copy.stage_load(mapping, view[at : at + chunk_bytes], [ChunkPart(0, list(range(first, first + per)))])
        wait = copy.flush_load(mapping)
        spent = time.perf_counter() - started
        wait()
        copy.wait_loads()
        return spent

    for k in range(10):  # Warm: allocator, kernels, the first launches.
        request(k)
    loader_ms = statistics.median(request(k) for k in range(args.requests)) * 1000
    figures = {"loader_ms_per_request": round(loader_ms, 3), "request_bytes": chunks * chunk_bytes}
    ratios: dict[str, float] = {}
    if cuda:
        target = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device=device)
        times = []
        for _ in range(20):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            target.copy_(mapping.tensor[: chunks * chunk_bytes], non_blocking=True)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        dma_ms = statistics.median(times)
        figures["dma_ms_per_request"] = round(dma_ms, 3)
        ratios["loader_vs_dma"] = round(loader_ms / dma_ms, 3)
    copy.close()
    mapping.close()
    figures["device"] = str(device)
    print(f"loader: {loader_ms:.3f} ms per request of {chunks} chunks x {args.layers} layers ({device})")
    if ratios:
        print(f"dma: {figures['dma_ms_per_request']} ms per request; loader_vs_dma {ratios['loader_vs_dma']}")
    if args.json:
        print(json.dumps({"figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
