"""What a save costs the prefill: completion marks (as shipped) vs committing before the step returns.

    .venv/bin/python bench/saves.py [--runs 2] [--prompt-tokens 3000] [--dtype float32] [--json]

A save must survive vLLM's default shutdown, which SIGKILLs the engine right
after its last response (see `kvharbor.connector.vllm.worker`). Two ways:

- ``marks`` (kvharbor's): the step waits while its chunks are copied into shared
  memory and marked complete; the commit (checksum, storage write) runs behind
  the engine, and a gateway whose engine died stores the marked values itself;
- ``commit_in_step``: the step also waits for the commit (the bench wraps the
  worker's save so), so nothing is left behind when the step returns.

Each engine is a fresh process (offline ``LLM``, the model of ``bench/e2e.py``,
``KVHARBOR=1`` with a fresh store) timing one prompt that misses and is saved,
after a warm-up shorter than a chunk. Per tier setup (``file``: the default
file tier, fsync on; ``ram``: a RAM tier in the gateway's shared memory, the
cheapest commit), the modes alternate over the rounds. Figures: time to first
token of the prompt and the seconds the engine waited in the connector's save
(``save_in_step_ms``), best of the rounds. Ratios: ``commit_in_step_prefill_cost_<tier>``,
the critical-path time committing in the step adds, as a share of the prefill
((commit_in_step save - marks save) / marks TTFT; timed in the engine, so free of
the noise a whole TTFT has on a shared machine), and
``commit_in_step_save_wait_vs_marks_<tier>``, the two saves' waits.

Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import BENCH_LINE_PREFIX, emit, run_engine_process  # noqa: E402
from e2e import MODEL, WARMUP_TOKENS, time_connector_steps  # noqa: E402

from kvharbor.demo.model import build_tiny_model  # noqa: E402

MODES = ("marks", "commit_in_step")
TIERS = ("file", "ram")


def commit_before_the_step_returns() -> None:
    """The alternative to marks: the worker's save returns only once its commit has."""
    from kvharbor.connector.link import CacheLink
    from kvharbor.connector.vllm.worker import WorkerSide

    committed = threading.Event()
    commit, save = CacheLink.commit, WorkerSide.save

    def commit_then_say(self: Any, *args: Any, **kwargs: Any) -> int:
        try:
            return int(commit(self, *args, **kwargs))
        finally:
            committed.set()

    def save_and_wait(self: Any, meta: Any) -> None:
        committed.clear()
        save(self, meta)
        if meta.saves:
            committed.wait()

    # The methods themselves are replaced: every instance the engine builds is to report.
    CacheLink.commit = commit_then_say  # type: ignore[method-assign]
    WorkerSide.save = save_and_wait  # type: ignore[method-assign]


def engine_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["mode"] == "commit_in_step":
        commit_before_the_step_returns()
    timings = time_connector_steps()  # Wraps the save above: its wait is timed too.
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=8192,
        max_num_batched_tokens=8192, disable_log_stats=False,
    )  # fmt: skip
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def timed(tokens: list[int]) -> float:
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        return time.perf_counter() - started

    timed(spec["warmup"])
    ttft = timed(spec["prompt"])
    print(BENCH_LINE_PREFIX + json.dumps({"ttft_s": ttft, "save_s": sum(timings["save"])}), flush=True)


def store_config(workdir: Path, tier: str, run: int) -> Path:
    """A fresh store for one engine: nothing of the prompt is stored yet."""
    store = workdir / f"store-{run}"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    tiers = {
        "file": [{"name": "local", "type": "file", "path": str(store / "cache"), "capacity_gb": 4}],
        "ram": [{"name": "ram", "type": "ram", "capacity_gb": 1}],
    }[tier]
    config = {
        "gateway": {"socket": str(workdir / "run" / f"gw-{run}.sock"), "shm_name": f"kvh-saves-{uuid.uuid4().hex[:8]}",
                    "ring_mb": 256},
        "storage": {"tiers": tiers, "fallback_path": None},  # No fallback tier beside the RAM-only run.
    }  # fmt: skip
    path = store / "kvharbor.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_engine(workdir: Path, spec: dict[str, Any], config: Path, run: int) -> dict[str, float]:
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {"KVHARBOR": "1", "KVHARBOR_CONFIG": str(config)}
    return run_engine_process(__file__, spec, env, workdir, tmp, f"{run:02d}-{spec['mode']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="rounds of each mode per tier (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--tiers", default=",".join(TIERS), help="tier setups to run (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvharbor-bench-saves"))
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(args.engine)
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(args.workdir / "model", max_position=8192, **MODEL)
    rng = random.Random(3000)
    prompt = [rng.randrange(4, 4096) for _ in range(args.prompt_tokens)]
    warmup = [rng.randrange(4, 4096) for _ in range(WARMUP_TOKENS)]
    tiers = [t for t in args.tiers.split(",") if t]
    figures: dict[str, Any] = {"prompt_tokens": len(prompt), "dtype": args.dtype, "runs": args.runs}
    ratios: dict[str, float] = {}
    run = 0
    for tier in tiers:
        best: dict[str, dict[str, float]] = {mode: {"ttft_s": float("inf"), "save_s": float("inf")} for mode in MODES}
        for round_no in range(args.runs):
            for mode in MODES if round_no % 2 == 0 else reversed(MODES):
                run += 1
                spec = {"model": str(model), "dtype": args.dtype, "prompt": prompt, "warmup": warmup, "mode": mode}
                result = run_engine(args.workdir, spec, store_config(args.workdir, tier, run), run)
                print(f"{tier} round {round_no + 1}/{args.runs} {mode:<15} TTFT {result['ttft_s']:.3f} s, "
                      f"in the save {result['save_s'] * 1000:.1f} ms", flush=True)  # fmt: skip
                for name in ("ttft_s", "save_s"):
                    best[mode][name] = min(best[mode][name], result[name])
        for mode in MODES:
            figures[f"{tier}_{mode}_ttft_s"] = best[mode]["ttft_s"]
            figures[f"{tier}_{mode}_save_in_step_ms"] = best[mode]["save_s"] * 1000
        added_s = best["commit_in_step"]["save_s"] - best["marks"]["save_s"]
        ratios[f"commit_in_step_prefill_cost_{tier}"] = added_s / best["marks"]["ttft_s"]
        ratios[f"commit_in_step_save_wait_vs_marks_{tier}"] = best["commit_in_step"]["save_s"] / best["marks"]["save_s"]
    print(f"A {len(prompt)}-token prompt computed and saved by a fresh engine ({args.dtype}, best of {args.runs}):")
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
