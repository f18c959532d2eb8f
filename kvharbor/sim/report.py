"""What a plan says: the JSON document, a table, PNG plots and one self-contained HTML page.

The JSON document (``kvharbor plan --json``) is one object; its ``results`` list
holds one entry per capacity, smallest first::

    {"capacity_tokens": 10000000, "capacity_blocks": 19531, "capacity_bytes": ...,
     "token_hit_rate": 0.2976, "hit_tokens": ..., "prompt_tokens": ...,
     "fleet": {...}}                      # only with --engines: the fleet run at that card size

The plots and the page need matplotlib (the ``plan`` extra); they are made only
for ``--out``.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvharbor.sim.fleet import FleetResult, Tier
from kvharbor.sim.sweep import CapacityResult, smallest_reaching


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One capacity: the global cache's result, and the fleet run at that card size if any."""

    sweep: CapacityResult
    fleet: FleetResult | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    source: str
    """The trace's path or the generator's name and parameters."""
    block_tokens: int
    policy: str
    requests: int
    kv_bytes_per_token: int | None
    """The model's, when one is named (capacities then also in bytes)."""
    points: tuple[PlanPoint, ...]
    target_hit_rate: float | None = None
    fleet_setup: dict[str, Any] | None = None
    """The fleet's settings (engines, model, GPU, routing, RAM), with --engines."""

    @property
    def smallest_reaching_target(self) -> CapacityResult | None:
        if self.target_hit_rate is None:
            return None
        return smallest_reaching([p.sweep for p in self.points], self.target_hit_rate)


def fleet_document(result: FleetResult) -> dict[str, Any]:
    return {
        "requests": result.requests,
        "token_hit_rate": result.token_hit_rate(),
        "token_hit_rate_by_tier": {tier.value: result.token_hit_rate(tier) for tier in Tier},
        "ttft_p50_s": result.ttft_quantile_s(0.5),
        "ttft_p99_s": result.ttft_quantile_s(0.99),
        "prefill_gpu_s": result.prefill_gpu_s,
        "prefill_gpu_s_saved": result.prefill_gpu_s_saved,
        "chose_load": result.chose_load,
        "chose_recompute": result.chose_recompute,
        "fill": [
            {
                "time_s": sample.time_s,
                "used_ratio": {tier.value: ratio for tier, ratio in sample.used_ratio.items()},
                "evictions": {tier.value: count for tier, count in sample.evictions.items()},
            }
            for sample in result.fill
        ],
    }


def document(plan: Plan) -> dict[str, Any]:
    """The JSON document of ``plan``."""
    results = []
    for point in plan.points:
        entry: dict[str, Any] = {
            "capacity_tokens": point.sweep.capacity_tokens,
            "capacity_blocks": point.sweep.capacity_blocks,
            "capacity_bytes": (
                point.sweep.capacity_tokens * plan.kv_bytes_per_token if plan.kv_bytes_per_token else None
            ),
            "token_hit_rate": point.sweep.token_hit_rate,
            "hit_tokens": point.sweep.hit_tokens,
            "prompt_tokens": point.sweep.prompt_tokens,
        }
        if point.fleet is not None:
            entry["fleet"] = fleet_document(point.fleet)
        results.append(entry)
    smallest = plan.smallest_reaching_target
    return {
        "source": plan.source,
        "block_tokens": plan.block_tokens,
        "policy": plan.policy,
        "requests": plan.requests,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "fleet_setup": plan.fleet_setup,
        "target_hit_rate": plan.target_hit_rate,
        "smallest_capacity_tokens": smallest.capacity_tokens if smallest else None,
        "results": results,
    }


def table(plan: Plan) -> str:
    """The plan as a fixed-width text table, with the target's answer below it."""
    fleet = any(p.fleet is not None for p in plan.points)
    head = f"{'capacity tokens':>16} {'GB':>9} {'token hit rate':>15}"
    if fleet:
        head += f" {'fleet hit':>10} {'gpu':>6} {'ram':>6} {'card':>6} {'TTFT p50 s':>11} {'TTFT p99 s':>11}"
        head += f" {'GPU-s saved':>12}"
    lines = [f"{plan.source}: {plan.requests} requests, block {plan.block_tokens} tokens, policy {plan.policy}", head]
    for point in plan.points:
        gb = point.sweep.capacity_tokens * plan.kv_bytes_per_token / 1e9 if plan.kv_bytes_per_token else None
        line = f"{point.sweep.capacity_tokens:>16,} {'-' if gb is None else f'{gb:.1f}':>9} "
        line += f"{point.sweep.token_hit_rate:>14.1%}"
        if point.fleet is not None:
            f = point.fleet
            line += f" {f.token_hit_rate():>10.1%}" + "".join(f" {f.token_hit_rate(t):>6.1%}" for t in Tier)
            line += f" {f.ttft_quantile_s(0.5):>11.3f} {f.ttft_quantile_s(0.99):>11.3f} {f.prefill_gpu_s_saved:>12.0f}"
        lines.append(line)
    if plan.target_hit_rate is not None:
        smallest = plan.smallest_reaching_target
        lines.append(
            f"smallest capacity reaching {plan.target_hit_rate:.1%}: "
            + (f"{smallest.capacity_tokens:,} tokens" if smallest else "none of these")
        )
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # Files only: no display needed.
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--out: plots need matplotlib: pip install 'kvharbor[plan]'") from None
    return plt


def plots(plan: Plan) -> dict[str, bytes]:
    """PNG images by file name: the hit-rate curve, and with a fleet the TTFT
    distribution and the tiers' fill over time (of the largest capacity)."""
    plt = _pyplot()
    images: dict[str, bytes] = {}
    capacities = [p.sweep.capacity_tokens for p in plan.points]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(capacities, [p.sweep.token_hit_rate for p in plan.points], marker="o", label="global cache")
    fleets = [p for p in plan.points if p.fleet is not None]
    if fleets:
        axes.plot(
            [p.sweep.capacity_tokens for p in fleets],
            [p.fleet.token_hit_rate() for p in fleets if p.fleet is not None],
            marker="s",
            label="fleet (GPU + tiers, loads chosen)",
        )
    axes.set(xscale="log", xlabel="cache capacity (tokens)", ylabel="token hit rate", title="Hit rate against capacity")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    images["hit_rate.png"] = _png(plt, figure)
    if fleets:
        largest = fleets[-1].fleet
        assert largest is not None
        figure, axes = plt.subplots(figsize=(7, 4))
        for point in (fleets[0], fleets[-1]) if len(fleets) > 1 else (fleets[0],):
            assert point.fleet is not None
            ttft = point.fleet.ttft_s
            axes.plot(
                ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=f"{point.sweep.capacity_tokens:,} tokens"
            )
        axes.set(xscale="log", xlabel="time to first token (s)", ylabel="share of requests", title="TTFT distribution")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        images["ttft.png"] = _png(plt, figure)
        figure, axes = plt.subplots(figsize=(7, 4))
        times = [s.time_s for s in largest.fill]
        for tier in Tier:
            if tier in largest.fill[-1].used_ratio:
                axes.plot(times, [s.used_ratio.get(tier, 0.0) for s in largest.fill], label=f"{tier.value} fill")
        axes.set(xlabel="simulated time (s)", ylabel="used / capacity", ylim=(0, 1.05), title="Tier fill over time")
        axes.grid(True, alpha=0.3)
        axes.legend()
        images["fill.png"] = _png(plt, figure)
    return images


def _png(plt: Any, figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def html_page(plan: Plan, images: dict[str, bytes]) -> str:
    """One page holding the table and every image inline (no file or network beside it)."""
    figures = "\n".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, data in images.items()
    )
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>kvharbor plan</title>"
        "<style>body{font-family:sans-serif;margin:2em}pre{background:#f4f4f4;padding:1em;overflow:auto}"
        "img{max-width:100%}</style></head><body>\n"
        f"<h1>kvharbor plan</h1>\n<pre>{html.escape(table(plan))}</pre>\n{figures}\n</body></html>\n"
    )


def write_outputs(plan: Plan, directory: Path, document_text: str) -> Sequence[Path]:
    """``report.json``, the PNGs and ``report.html`` into ``directory``; returns their paths."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out: cannot create {directory} ({err.strerror})") from None
    images = plots(plan)
    written = [directory / "report.json"]
    written[0].write_text(document_text)
    for name, data in images.items():
        (directory / name).write_bytes(data)
        written.append(directory / name)
    page = directory / "report.html"
    page.write_text(html_page(plan, images))
    written.append(page)
    return written
