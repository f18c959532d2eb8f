"""A sliding-window model on a GPU engine: one vLLM process stores a prompt, the next restores it.

    python bench/gpu_window.py [--out DIR] [--tokens 2000] [--window 512] [--shape tiny|7b|gdn] [--cases A,B]

Builds the tiny random Llama (`kvharbor.demo.model`) and its sliding-window twin (a Mistral
whose every layer attends to ``--window`` tokens, `tests.support.tiny_model`); with ``--shape
7b`` both get Mistral-7B's shape instead (32 layers, 8 KV heads of 128, bf16, random weights
through ``load_format="dummy"``: 128 KiB of KV per token) and answer one token; ``hybrid-7b``
is the same shape as a Llama whose even layers attend to the window and odd ones to all
(Gemma-style ``layer_types``: vLLM's hybrid allocator gives each kind a cache group with
blocks of its own). With ``--shape gdn``, ``gdn`` is a Qwen3-Next-style hybrid (24 layers, three
Gated DeltaNet ones to each full-attention one, 16 experts, bf16, random weights; vLLM's
``--mamba-cache-mode align``), beside ``full-gdn``, a Llama of its attention shape in every
layer (2 KV heads of 256): the two log the bytes of a chunk and of a state (kvharbor's start
lines); ``gdn-80b`` is Qwen3-Next-80B-A3B's shape (48 layers, 10 of 128 experts per token:
`GDN_80B`). ``--cases`` picks some of the cases by name. Then for each
runs two engine processes one after the other with ``KVHARBOR=1`` and the default embedded
gateway (which lingers between them, holding its RAM tier): the first answers the prompt
cold, the second answers it again; each then answers it once more with vLLM's own prefix
cache emptied (``again_*``: a restore from kvharbor in a warm process). The sliding-window
model runs with asynchronous scheduling off (kvharbor refuses it for such a model), and once
more with vLLM's default, to show what that default does. The large shapes (``7b``, ``gdn``)
warm each engine up first with a prompt shorter than a chunk (first-request kernel builds are
not the cache's doing), time each answer's steps (`gpu_timeline.clock_request`:
``steps_ms``, ``cpu_ms``) and add vLLM's own floor (``floor_*``: the same prefix from its GPU
prefix cache, an uncached tail of the same length computed) and a cold answer of an unseen prompt
in the warm process (``steady_cold_*``: the ratios against it leave out kernel builds that the
first long prompt may still pay). Prints one JSON line per
engine: the tokens restored (``num_cached_tokens``), the output ids and the answer's time;
then a summary line. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8


WARMUP_TOKENS = 500
"""The warm-up prompt of the large shapes: shorter than one of their 544-token chunks."""


def prompt(tokens: int, seed: int = 11) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(tokens)]


SEVEN_B: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 32768,
    "max_position_embeddings": 65536,
    "torch_dtype": "bfloat16",
}
"""Mistral-7B's shape (its ``config.json``), written over the tiny model's."""


def seven_b(source: Path, path: Path, window: int | None, alternate: bool = False) -> Path:
    """A config-only model of Mistral-7B's shape (random weights at load), with the tiny
    model's tokenizer; every layer attends to ``window`` tokens, or to all (None); with
    ``alternate``, a Llama whose even layers attend to ``window`` and odd ones to all."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    config.update(SEVEN_B, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    if alternate:
        kinds = ("sliding_attention", "full_attention")
        layers = [kinds[i % 2] for i in range(SEVEN_B["num_hidden_layers"])]
        config.update(architectures=["LlamaForCausalLM"], model_type="llama", layer_types=layers)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


GDN: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 5120,
    "vocab_size": 32768,
    "max_position_embeddings": 65536,
    "torch_dtype": "bfloat16",
}
"""The attention shape of both ``--shape gdn`` models (Qwen3-Next's, at 24 layers of 2048)."""
GDN_LINEAR = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "full_attention_interval": 4,
}
"""Qwen3-Next's Gated DeltaNet and expert settings (its ``config.json``), with fewer experts."""


GDN_80B: dict[str, Any] = {
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 10,
    "vocab_size": 151936,
}
"""Qwen3-Next-80B-A3B's shape (its ``config.json``: 48 layers, 10 routed experts per token)
with 128 of its 512 experts, written over `GDN` and `GDN_LINEAR`: the same work per token
(and 20 of its 80 billion weights, so that it fits one GPU)."""


def gdn(source: Path, path: Path, hybrid: bool, extra: dict[str, Any] | None = None) -> Path:
    """A config-only model of `GDN`'s shape (random weights at load) with the tiny model's
    tokenizer: a Qwen3-Next whose every fourth layer is full attention (``hybrid``), or a Llama
    with full attention in every layer; ``extra`` written over both."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    config.update(GDN, **(extra or {}))
    if hybrid:
        kinds = ["linear_attention"] * 3 + ["full_attention"]
        layers = [kinds[i % 4] for i in range(config["num_hidden_layers"])]
        config.update(GDN_LINEAR, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", layer_types=layers)
        config.update(extra or {})  # Over `GDN_LINEAR`'s expert counts.
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def engine(model: str, tokens: int, asynchronous: str) -> None:
    config = json.loads((Path(model) / "config.json").read_text())
    large = config["hidden_size"] >= GDN["hidden_size"]
    if large:  # The connector's and vLLM's steps in this process, for `clock_request`.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    from gpu_timeline import clock_request
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {} if asynchronous == "default" else {"async_scheduling": asynchronous == "on"}
    if config.get("model_type") == "qwen3_next":
        # The admission reserve a restored state needs (kvharbor's check); FLA's Triton kernel
        # for prefill (FlashInfer's, vLLM's choice on Hopper, is not installed there).
        kwargs.update(
            mamba_cache_mode="align",
            enable_prefix_caching=True,
            watermark=0.01,
            additional_config={"gdn_prefill_backend": "triton"},
        )
    if large:
        kwargs.update(load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.8, max_model_len=tokens + 64)
    else:
        kwargs.update(gpu_memory_utilization=0.3, max_model_len=4096)
    llm = LLM(model=model, enforce_eager=True, **kwargs)
    params = SamplingParams(max_tokens=1 if large else MAX_TOKENS, temperature=0)

    def answer(ids: list[int]) -> tuple[Any, float, dict[str, Any] | None]:
        """One request: its output, seconds, and (large shapes) where the time went."""
        run = lambda: llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)  # noqa: E731
        start = time.perf_counter()
        outputs, clock = clock_request(run) if large else (run(), None)
        return outputs[0], time.perf_counter() - start, clock

    ids = prompt(tokens)
    if large:  # Warms vLLM's kernels; shorter than a chunk (544 tokens), so kvharbor keeps none of it.
        answer(prompt(WARMUP_TOKENS, seed=999))
    result: dict[str, Any] = {}
    for attempt in ("", "again_"):  # again: vLLM's own prefix cache emptied, kvharbor's kept
        out, seconds, clock = answer(ids)
        result |= {f"{attempt}cached": out.num_cached_tokens, f"{attempt}seconds": seconds}
        if clock is not None:
            result[f"{attempt}steps_ms"] = clock["steps_ms"]
            result[f"{attempt}cpu_ms"] = {name: span["total_ms"] for name, span in clock["cpu"].items()}
            result[f"{attempt}after_load_gpu_ms"] = clock.get("after_load_gpu_ms")
        result.setdefault("output", list(out.outputs[0].token_ids))
        result[f"{attempt}same_output"] = list(out.outputs[0].token_ids) == result["output"]
        llm.reset_prefix_cache()
    if large:
        # vLLM's own floor: the prefix restored once more (untimed) is in its GPU prefix
        # cache, and an uncached tail of the same length is computed.
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        hit = result["again_cached"]
        out, seconds, clock = answer(ids[:hit] + prompt(tokens - hit, seed=7))
        result |= {"floor_cached": out.num_cached_tokens, "floor_seconds": seconds}
        if clock is not None:
            result["floor_steps_ms"] = clock["steps_ms"]
        # A cold answer in a warm process: an unseen prompt of the same length (this process's
        # own seed, so that neither cache holds it). The first cold answer may still build
        # kernels for the long shapes that the short warm-up did not reach.
        out, seconds, _ = answer(prompt(tokens, seed=1000 + os.getpid()))
        result |= {"steady_cold_cached": out.num_cached_tokens, "steady_cold_seconds": seconds}
    print("ANSWER " + json.dumps(result), flush=True)


def run(model: Path, tokens: int, asynchronous: str, config: Path, log: Path) -> dict[str, Any]:
    env = {**os.environ, "KVHARBOR": "1", "KVHARBOR_CONFIG": str(config)}
    command = [
        sys.executable,
        __file__,
        "--engine",
        str(model),
        "--tokens",
        str(tokens),
        "--asynchronous",
        asynchronous,
    ]
    with open(log, "w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    answers = [json.loads(line[len("ANSWER ") :]) for line in text.splitlines() if line.startswith("ANSWER ")]
    lines = sorted({line.split("kvharbor: ", 1)[1][:200] for line in text.splitlines() if "kvharbor: " in line})
    return {"returncode": done.returncode, "answer": answers[0] if answers else None, "kvharbor_lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the models, configs and logs go (default: a temp dir)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--shape", default="tiny", choices=("tiny", "7b", "gdn"))
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all of the shape)")
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--asynchronous", default="default", choices=("default", "on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine is not None:
        engine(args.engine, args.tokens, args.asynchronous)
        return
    sys.path.insert(0, str(REPO))
    from kvharbor.demo.model import build_tiny_model
    from tests.support.tiny_model import mixed_window_model, sliding_window_model

    out = Path(args.out or tempfile.mkdtemp(prefix="kvh-gpu-window-"))
    out.mkdir(parents=True, exist_ok=True)
    llama = build_tiny_model(out / "llama")
    window = sliding_window_model(llama, out / "window", args.window)
    cases: tuple[tuple[str, Path, str], ...] = (
        ("llama", llama, "default"),
        ("window", window, "off"),
        ("window-default", window, "default"),
        ("mixed", mixed_window_model(llama, out / "mixed", args.window), "off"),
    )
    ram_gb = 2
    if args.shape == "7b":
        full, windowed = seven_b(llama, out / "full-7b", None), seven_b(llama, out / "window-7b", args.window)
        hybrid = seven_b(llama, out / "hybrid-7b", args.window, alternate=True)
        cases = (("full-7b", full, "off"), ("window-7b", windowed, "off"), ("hybrid-7b", hybrid, "off"))
        ram_gb = 2 * args.tokens * 128 * 1024 // 2**30 + 1
    if args.shape == "gdn":
        full_gdn, hybrid_gdn = gdn(llama, out / "full-gdn", False), gdn(llama, out / "gdn", True)
        big = gdn(llama, out / "gdn-80b", True, GDN_80B)
        cases = (("full-gdn", full_gdn, "default"), ("gdn", hybrid_gdn, "default"), ("gdn-80b", big, "default"))
        ram_gb = 2 * args.tokens * 48 * 1024 // 2**30 + 4
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = tuple(case for case in cases if case[0] in wanted)
    summary: dict[str, Any] = {"tokens": args.tokens, "window": args.window, "shape": args.shape}
    for name, model, asynchronous in cases:
        config = out / f"{name}.yaml"
        tiers = [
            {"name": "ram", "type": "ram", "capacity_gb": ram_gb},
            {"name": "files", "type": "file", "path": f"{out / name}-files", "capacity_gb": 2 * ram_gb},
        ]
        gateway = {"socket": f"{out / name}.sock", "shm_name": f"kvh-gpu-{name}"}
        config.write_text(yaml.safe_dump({"gateway": gateway, "storage": {"tiers": tiers}}))
        runs = [run(model, args.tokens, asynchronous, config, out / f"{name}-{i}.log") for i in (1, 2)]
        for i, result in enumerate(runs, start=1):
            print(json.dumps({"model": name, "process": i, **result}), flush=True)
        cold, warm = (r["answer"] for r in runs)
        if cold and warm:
            summary[name] = {
                "restored_tokens": warm["cached"],
                "same_output": warm["output"] == cold["output"],
                "restart_vs_cold": warm["seconds"] / cold["seconds"],
                "warm_restore_vs_cold": warm["again_seconds"] / cold["seconds"],
            }
            if "floor_seconds" in warm:
                summary[name]["floor_vs_cold"] = warm["floor_seconds"] / cold["seconds"]
            if "steady_cold_seconds" in warm:  # Against a cold answer of the same (warm) process.
                steady = warm["steady_cold_seconds"]
                summary[name] |= {
                    "cold_seconds": cold["seconds"],
                    "steady_cold_seconds": steady,
                    "restart_vs_steady_cold": warm["seconds"] / steady,
                    "warm_restore_vs_steady_cold": warm["again_seconds"] / steady,
                    "floor_vs_steady_cold": warm["floor_seconds"] / steady,
                }
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
