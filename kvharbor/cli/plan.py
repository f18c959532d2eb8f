"""``kvharbor plan``: how large must the cache be for this traffic, and what does it buy?

    kvharbor plan (--trace FILE | --workload {system-prompts,chat,rag} [--requests N] [--rate-per-s R] [--seed S])
                  [--block-tokens 512] [--capacity-tokens 3e6,1e7,5e7] [--card-gb 100,500] [--policy lru|slru]
                  [--target-hit-rate 0.3] [--engines N --model M --gpu G --tensor-parallel T --ram-gb X
                   --routing round-robin|prefix-aware --card-params PARAMS.yaml] [--json] [--out DIR]
                  [--progress | --no-progress]

Every capacity (``--capacity-tokens``, and ``--card-gb`` turned into tokens with the
model's KV bytes per token) is replayed as one global cache that all requests share;
``--json`` prints one object whose ``results`` list holds, per capacity,
``capacity_tokens`` and ``token_hit_rate`` (hit prompt tokens / all prompt tokens)
among other fields. With ``--engines N`` each capacity is also the card tier of a
simulated fleet of N engines (`kvharbor.sim.fleet`): its per-tier hit rates, TTFT
p50 and p99 and prefill GPU-seconds saved join that capacity's entry. ``--out DIR``
writes report.json, PNG plots and one self-contained report.html.

Bad input (a malformed trace line, a decreasing timestamp, a capacity of zero or
below, an unknown model or GPU, an empty trace) is refused before anything is
printed, naming the line or the flag; exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvharbor.cli import Subparsers

if TYPE_CHECKING:
    from kvharbor.sim.workload import Request

DEFAULT_CAPACITIES_TOKENS = (1e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9)
GIB = 1 << 30


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="size the cache for a workload: hit rate against capacity, TTFT and GPU time of a fleet",
        description="Replay a trace (Mooncake JSONL) or a generated workload against caches of several "
        "capacities; with --engines, simulate a fleet of engines with GPU, host-RAM and card tiers.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace", metavar="FILE", help="JSONL trace: timestamp (ms), input_length, output_length, hash_ids"
    )
    source.add_argument("--workload", choices=("system-prompts", "chat", "rag"), help="a generated workload")
    parser.add_argument("--requests", type=int, default=10_000, help="--workload: requests to generate (default 10000)")
    parser.add_argument(
        "--rate-per-s", type=float, default=20.0, help="--workload: mean arrivals per second (default 20)"
    )
    parser.add_argument("--seed", type=int, default=0, help="--workload: random seed (default 0)")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per block id of the trace (default 512)")
    parser.add_argument(
        "--capacity-tokens", metavar="LIST", help="comma-separated capacities in tokens, e.g. 3e6,1e7,5e7"
    )
    parser.add_argument("--card-gb", metavar="LIST", help="comma-separated capacities in GiB of the model's KV")
    parser.add_argument("--policy", default="lru", help="eviction policy: lru (default) or slru")
    parser.add_argument(
        "--target-hit-rate", type=float, help="report the smallest capacity reaching this token hit rate (0-1)"
    )
    parser.add_argument("--engines", type=int, help="simulate a fleet of this many engines at each capacity")
    parser.add_argument("--model", default="llama-3.1-8b", help="llama-3.1-8b (default) or llama-3.1-70b")
    parser.add_argument("--gpu", default="h200", help="h200 (default) or h100")
    parser.add_argument("--tensor-parallel", type=int, help="GPUs per engine (default: the model's, 1 or 4)")
    parser.add_argument(
        "--ram-gb", type=float, default=0.0, help="--engines: a shared host-RAM tier of this size (GiB)"
    )
    parser.add_argument("--routing", default="prefix-aware", help="--engines: prefix-aware (default) or round-robin")
    parser.add_argument(
        "--card-params", metavar="PARAMS.yaml", help="--engines: the simulated card's timing parameters"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="DIR", help="write report.json, PNG plots and report.html here")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None, help="show a progress bar")
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="never show one")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: every command module is imported to build the parser.
    from kvharbor.hal.sim.params import CardParams, load_params
    from kvharbor.sim.caches import Policy
    from kvharbor.sim.cost import engine_cost
    from kvharbor.sim.errors import PlanInputError
    from kvharbor.sim.fleet import FleetConfig, Routing, run_fleet
    from kvharbor.sim.progress import ProgressBar
    from kvharbor.sim.report import Plan, PlanPoint, document, table, write_outputs
    from kvharbor.sim.sweep import passes, sweep

    if args.block_tokens <= 0:
        raise PlanInputError(f"--block-tokens: must be > 0 (got {args.block_tokens})")
    if args.target_hit_rate is not None and not 0 < args.target_hit_rate <= 1:
        raise PlanInputError(f"--target-hit-rate: must be in (0, 1] (got {args.target_hit_rate})")
    if args.engines is not None and args.engines <= 0:
        raise PlanInputError(f"--engines: must be > 0 (got {args.engines})")
    if args.ram_gb < 0:
        raise PlanInputError(f"--ram-gb: must be >= 0 (got {args.ram_gb})")
    policy = Policy.parse(args.policy)
    routing = Routing.parse(args.routing)
    engine = engine_cost(args.model, args.gpu, args.tensor_parallel)
    kv = engine.kv_bytes_per_token
    capacities = _capacities(args.capacity_tokens, args.card_gb, kv)
    card = load_params(args.card_params) if args.card_params else CardParams()
    requests, source = _requests(args)
    show = sys.stderr.isatty() if args.progress is None else args.progress

    bar = ProgressBar(passes(policy, len(capacities)) * len(requests), sys.stderr, "sweep", show)
    results = sweep(requests, capacities, args.block_tokens, policy, bar)
    bar.close()
    points = [PlanPoint(result) for result in results]
    setup = None
    if args.engines is not None:
        setup = {
            "engines": args.engines,
            "model": engine.model.name,
            "gpu": engine.gpu.name,
            "tensor_parallel": engine.tensor_parallel,
            "gpu_cache_tokens": engine.gpu_cache_tokens,
            "ram_tokens": int(args.ram_gb * GIB // kv),
            "routing": routing.value,
        }
        for index, result in enumerate(results):
            config = FleetConfig(
                engines=args.engines,
                engine=engine,
                block_tokens=args.block_tokens,
                card_tokens=result.capacity_tokens,
                ram_tokens=int(args.ram_gb * GIB // kv),
                policy=policy,
                routing=routing,
                card=card,
            )
            bar = ProgressBar(len(requests), sys.stderr, f"fleet {index + 1}/{len(results)}", show)
            points[index] = PlanPoint(result, run_fleet(config, requests, len(requests), bar))
            bar.close()
    plan = Plan(source, args.block_tokens, policy.value, len(requests), kv, tuple(points), args.target_hit_rate, setup)
    text = json.dumps(document(plan), indent=2)
    if args.out:
        for path in write_outputs(plan, Path(args.out), text):
            print(f"kvharbor: wrote {path}", file=sys.stderr)
    print(text if args.json else table(plan))
    return 0


def _capacities(tokens: str | None, card_gb: str | None, kv_bytes_per_token: int) -> list[float]:
    """The capacities in tokens, ascending, each once."""
    from kvharbor.sim.errors import PlanInputError

    values: list[float] = []
    if tokens is not None:
        values += _numbers(tokens, "--capacity-tokens")
    if card_gb is not None:
        values += [gb * GIB / kv_bytes_per_token for gb in _numbers(card_gb, "--card-gb")]
    if tokens is None and card_gb is None:
        values = list(DEFAULT_CAPACITIES_TOKENS)
    for value in values:
        if not value > 0:
            raise PlanInputError(f"--capacity-tokens/--card-gb: a capacity must be > 0 (got {value:g})")
    return sorted(set(values))


def _numbers(text: str, flag: str) -> list[float]:
    from kvharbor.sim.errors import PlanInputError

    numbers = []
    for part in text.split(","):
        try:
            numbers.append(float(part))
        except ValueError:
            raise PlanInputError(
                f"{flag}: {part.strip()!r} is not a number (a comma-separated list: 3e6,1e7)"
            ) from None
    if not all(n == n and n not in (float("inf"), float("-inf")) for n in numbers):
        raise PlanInputError(f"{flag}: capacities must be finite numbers")
    return numbers


def _requests(args: argparse.Namespace) -> tuple[list[Request], str]:
    from kvharbor.sim.workload import GENERATORS, Arrivals, generate, read_trace

    if args.trace is not None:
        return read_trace(args.trace, args.block_tokens), args.trace
    params = GENERATORS[args.workload]()
    generated = list(generate(params, args.requests, args.block_tokens, Arrivals(args.rate_per_s), args.seed))
    return generated, f"{args.workload} ({params}, {args.requests} requests at {args.rate_per_s:g}/s, seed {args.seed})"
