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
FLUSH_WAIT_S = 60
"""How long SGLang may take to become idle after an answer, so that its caches can be flushed."""


def prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(tokens)]


def flush_when_idle(engine: object) -> None:
    """Flush SGLang's device and host caches once its scheduler is idle. The answer comes back
    before the scheduler has retired its last batch (``last_batch``): until then
    ``flush_cache`` refuses ("pending requests", with none queued or running), so it is asked
    again until it flushes, within `FLUSH_WAIT_S`. Each ask is a round trip through the
    scheduler's own loop, the loop that retires the batch."""
    deadline = time.monotonic() + FLUSH_WAIT_S
    while not engine.flush_cache().success:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"SGLang did not become idle to flush its caches in {FLUSH_WAIT_S} s"


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
            flush_when_idle(engine)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
