"""How fast the planner runs: the Mooncake trace at 10 capacities, and a 1 M-request fleet.

Two figures, each a single run (a run is long; its own time is the figure), wall
and CPU seconds beside each other since the machines are shared:

- ``trace_sweep``: `kvharbor.sim.sweep` of the 12,031-request Mooncake conversation
  trace at 10 capacities, ``lru`` (one pass by stack distances), reading the trace
  included (target: < 30 s);
- ``fleet``: `kvharbor.sim.fleet` of a generated multi-turn chat workload of
  ``--requests`` (1 M) requests on 8 Llama-3.1-8B/H200 engines with a card tier,
  prefix-aware routing; its peak resident memory (target: < 5 min and < 2 GB).

Nothing is asserted: the targets are read off.

    .venv/bin/python bench/planner.py [--trace PATH] [--requests 1000000] [--json]

With ``--json`` the last line is ``{"figures": {...}, "ratios": {...}}``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from common import emit

from kvharbor.sim.caches import Policy
from kvharbor.sim.cost import engine_cost
from kvharbor.sim.fleet import FleetConfig, Routing, Tier, run_fleet
from kvharbor.sim.sweep import sweep
from kvharbor.sim.workload import Arrivals, MultiTurnChat, generate, read_trace

CAPACITIES_TOKENS = (1e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 5e7, 1e8, 1e9)
TRACE_NAME = "mooncake_conversation_trace.jsonl"
T = TypeVar("T")


def default_trace() -> Path:
    """The Mooncake conversation trace vendored in ``data/traces/``."""
    return Path(__file__).resolve().parents[1] / "data" / "traces" / TRACE_NAME


def timed(work: Callable[[], T]) -> tuple[T, float, float]:
    """``work``'s result, its wall seconds and its CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=default_trace())
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results, sweep_wall_s, sweep_cpu_s = timed(
        lambda: sweep(read_trace(args.trace, 512), CAPACITIES_TOKENS, 512, Policy.LRU)
    )
    print(f"trace sweep: {args.trace.name}, {len(CAPACITIES_TOKENS)} capacities (lru, one pass)")
    for result in results:
        print(f"  {result.capacity_tokens:>13,} tokens  {result.token_hit_rate:6.1%}")

    engine = engine_cost("llama-3.1-8b", "h200")
    config = FleetConfig(
        engines=8, engine=engine, block_tokens=512, card_tokens=100_000_000, routing=Routing.PREFIX_AWARE
    )
    workload = generate(MultiTurnChat(), args.requests, 512, Arrivals(40.0), seed=0)
    fleet, fleet_wall_s, fleet_cpu_s = timed(lambda: run_fleet(config, workload, args.requests))
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"fleet: {args.requests:,} chat requests, 8 engines llama-3.1-8b/h200, card 1e8 tokens, prefix-aware")
    print(
        f"  hit {fleet.token_hit_rate():.1%} (gpu {fleet.token_hit_rate(Tier.GPU):.1%}, "
        f"card {fleet.token_hit_rate(Tier.CARD):.1%}), TTFT p50 {fleet.ttft_quantile_s(0.5):.3f} s "
        f"p99 {fleet.ttft_quantile_s(0.99):.3f} s"
    )
    emit(
        {
            "trace_sweep_wall_s": sweep_wall_s,
            "trace_sweep_cpu_s": sweep_cpu_s,
            "fleet_requests": args.requests,
            "fleet_wall_s": fleet_wall_s,
            "fleet_cpu_s": fleet_cpu_s,
            "peak_rss_mb": peak_rss_mb,
        },
        {
            "trace_sweep_vs_30_s": sweep_wall_s / 30.0,
            "fleet_vs_300_s": fleet_wall_s / 300.0,
            "rss_vs_2_gb": peak_rss_mb / 2048,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
