"""One SGLang engine process: ``python engine_worker.py MODEL PROMPT_TOKENS SEED ASKS``.

Runs SGLang's offline `Engine` on the CPU (the tiny model at MODEL, HiCache on, the page
path the test shims cover), sends the same prompt ASKS times (greedy, 4 tokens), clearing
SGLang's own device and host caches (``flush_cache``) after each answer so that the next
one can only hit storage, and prints one JSON line per answer: the output ids, SGLang's
``cached_tokens``, the part of them read from storage and the answer's wall time. kvharbor
comes in as a user brings it: ``KVHARBOR=1`` in the environment (`engine_rig` sets it).
"""

from __future__ import annotations

import json
import random
import sys
import time

PAGE_TOKENS = 16
MAX_NEW_TOKENS = 4


def prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(tokens)]


def main(model: str, tokens: int, seed: int, asks: int) -> None:
    import sglang

    engine = sglang.Engine(
        model_path=model,
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        mem_fraction_static=0.5,
        max_total_tokens=8192,
        page_size=PAGE_TOKENS,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        # SGLang's default ("timeout": 1 s + 0.25 s per 1,024 tokens) drops a read-back that
        # takes longer, as a fresh process's first one can on a loaded 2-core machine (seen
        # once in CI: 0 storage tokens); what is tested is what is read back, not how fast.
        hicache_storage_prefetch_policy="wait_complete",
        log_level="info",
    )
    try:
        ids = prompt(tokens, seed)
        for _ in range(asks):
            start = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0})
            meta = out["meta_info"]
            details = meta.get("cached_tokens_details") or {}
            answer = {
                "output_ids": out["output_ids"],
                "cached_tokens": meta["cached_tokens"],
                "storage_tokens": details.get("storage", 0),
                "storage_backend": details.get("storage_backend"),
                "seconds": time.perf_counter() - start,
            }
            print("ANSWER " + json.dumps(answer), flush=True)
            assert engine.flush_cache().success, "SGLang refused to flush its caches"
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
