"""The loader thread's own time per load request, against the copy it feeds.

A restore's loader thread stages each gateway answer and launches its copies and
scatters (`DeviceCopy.stage_load`, `DeviceCopy.flush_load`). While vLLM's thread
prepares a step it holds the interpreter and the loader stops, so the copies queued
before must last: how fast the loader queues requests, against how fast the copy
engine empties them, decides how far ahead of the copies it can get in the time the
engine's thread waits for it (`engine.load_start_wait_ms`, `docs/performance.md`).

On a GPU, `DeviceCopy` runs over the KV cache of ``bench/gpu.py`` (Llama-3.1-8B's
shape: 32 layers, 16-token blocks of 64 KiB in flash-attn's layout) with the engine's
defaults (`EngineSection`: requests of ``engine.load_batch_mb``) from page-locked memory,
and each request's host-to-device copy is timed alone. On the CPU
(``KVH_BENCH_DEVICE=cpu`` or no GPU) the pages are 256 B and a request holds as many
chunks as on a GPU: the copies would dominate and there is no copy engine to compare
against, so only the loader's own (Python and dispatch) time is measured.

    .venv/bin/python bench/loader.py [--requests 200] [--json]

With ``--json`` the last line is ``{"figures": {...}, "ratios": {...}}``:
``loader_vs_dma`` below 1 means the loader outpaces the copies, by ``1 - ratio`` of a
request's copy time per request queued. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import torch
from common import emit
from gpu import BLOCK, DEVICE, HEAD, KV_HEADS, LAYERS, PER_CHUNK, kv_tensors, median_s

from kvharbor.config import EngineSection
from kvharbor.connector.vllm.chunks import ChunkPart
from kvharbor.connector.vllm.copier import load_request_chunks
from kvharbor.connector.vllm.device_copy import DeviceCopy
from kvharbor.connector.vllm.pinning import PinnedMapping, cuda_host_register

CPU_PAGE_ELEMS = 128
"""A page on the CPU (256 B of bf16): small enough that the copies cost next to nothing beside the calls."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cuda = DEVICE == "cuda" and torch.cuda.is_available()
    engine = EngineSection()
    # As many chunks per request as the engine's requests hold on a GPU (bf16 pages of K and V).
    chunks = load_request_chunks(engine.load_batch_bytes, LAYERS * PER_CHUNK * BLOCK * KV_HEADS * 2 * HEAD * 2)
    num_blocks = 4 * chunks * PER_CHUNK  # Four requests' worth of blocks: each request lands elsewhere.
    if cuda:
        tensors = kv_tensors(num_blocks)
    else:
        tensors = [torch.zeros(num_blocks, CPU_PAGE_ELEMS, dtype=torch.bfloat16) for _ in range(LAYERS)]
    chunk_bytes = LAYERS * PER_CHUNK * tensors[0][0].numel() * tensors[0].element_size()
    copy = DeviceCopy(
        tensors,
        num_blocks,
        PER_CHUNK,
        chunks * chunk_bytes,
        engine.save_staging_bytes_max,
        None,
        engine.loads_in_flight_max,
        engine.load_layered_row_bytes,
    )
    if copy.chunks_per_load != chunks or copy.chunk_bytes != chunk_bytes:
        raise RuntimeError(
            f"{copy.chunks_per_load} chunks of {copy.chunk_bytes} B per request, not {chunks} of {chunk_bytes}"
        )
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
            first = ((k % 4) * chunks + c) * PER_CHUNK
            copy.stage_load(mapping, view[at : at + chunk_bytes], [ChunkPart(0, list(range(first, first + PER_CHUNK)))])
        wait = copy.flush_load(mapping)
        spent = time.perf_counter() - started
        wait.synchronize()
        copy.wait_loads()
        return spent

    for k in range(10):  # Warm: allocator, kernels, the first launches.
        request(k)
    loader_ms = statistics.median(request(k) for k in range(args.requests)) * 1000
    figures: dict[str, object] = {
        "loader_ms_per_request": round(loader_ms, 3),
        "chunks_per_request": chunks,
        "request_bytes": chunks * chunk_bytes,
        "device": "cuda" if cuda else "cpu",
    }
    ratios: dict[str, float] = {}
    if cuda:
        target = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device="cuda")
        dma_s, _ = median_s(lambda: target.copy_(mapping.tensor[: chunks * chunk_bytes], non_blocking=True), 20)
        figures["dma_ms_per_request"] = round(dma_s * 1000, 3)
        ratios["loader_vs_dma"] = round(loader_ms / (dma_s * 1000), 3)
    copy.close()
    mapping.close()
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
