"""kvharbor's numbers in vLLM's connector stats: what was looked up, moved and skipped, and how long it took.

Workers (loads, saves) and the scheduler (lookups, skipped requests) collect
them per step; vLLM aggregates them across workers, logs
``KV Transfer metrics: ...`` every stats interval and hands each step's
numbers to `KVHarborPromMetrics`, which keeps them as ``vllm:kvharbor_*``
series on ``/metrics`` (and in ``LLM.get_metrics()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

_SUMMED = (
    "lookups",
    "lookup_chunks",
    "hit_chunks",
    "verified_chunks",
    "unverified_chunks",
    "loaded_chunks",
    "loaded_bytes",
    "load_s",
    "loads",
    "stored_chunks",
    "stored_bytes",
    "save_s",
    "saves",
    "load_errors",
    "unsalted_skipped",
    "bad_salt_skipped",
    "short_prompts",
    "chose_recompute",
    "loads_cut",
    "save_dropped",
    "prefill_flops",
    "prefill_s",
)
_MAXED = ("cache_off", "saves_pending")
"""``cache_off``: 1 when the external cache is off on some rank. ``saves_pending``: the
saves some worker has not counted yet (not exported: it keeps the engine stepping
until they are, see `worker`)."""

_HELP = {
    "lookups": "Requests whose prompt chunks were looked up in kvharbor",
    "lookup_chunks": "Prompt chunks looked up in kvharbor",
    "hit_chunks": "Prompt chunks kvharbor promised: stored, and in RAM or read back intact",
    "verified_chunks": "Stored chunks outside RAM read back intact before they were promised",
    "unverified_chunks": "Stored chunks not promised (damaged, of the wrong size, or not read back within "
    "engine.verify_wait_ms); recomputed",
    "loaded_chunks": "Chunks restored from kvharbor into the KV cache",
    "loaded_bytes": "Bytes restored from kvharbor into the KV cache",
    "load_s": "Seconds spent restoring chunks (on the engine's critical path)",
    "loads": "Steps that restored chunks",
    "stored_chunks": "Chunks newly stored in kvharbor",
    "stored_bytes": "Bytes newly stored in kvharbor",
    "save_s": "Seconds spent storing chunks (behind the engine)",
    "saves": "Steps whose chunks were stored",
    "load_errors": "Promised blocks that kvharbor could not deliver after all (recomputed; vLLM's own "
    "cached-token counts still include them)",
    "unsalted_skipped": "Requests not cached because engine.require_cache_salt is on and they had no salt",
    "bad_salt_skipped": "Requests not cached because their cache_salt was not a string",
    "short_prompts": "Prompts shorter than one chunk (nothing to look up)",
    "chose_recompute": "Requests whose stored prefix was recomputed because loading it was predicted slower",
    "loads_cut": "Restores stopped part-way because the rest would arrive slower than it recomputes",
    "save_dropped": "Chunks not saved because the GPU staging for saves was full (future misses)",
    "prefill_flops": "Prefill FLOPs of the timed forward passes (steps that loaded nothing)",
    "prefill_s": "Seconds of the timed forward passes; prefill_flops / prefill_s is the measured rate",
}


def empty() -> dict[str, float]:
    return dict.fromkeys(_SUMMED + _MAXED, 0)


@dataclass
class KVHarborStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty()

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in _SUMMED:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        for name in _MAXED:
            self.data[name] = max(self.data.get(name, 0), other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {**empty(), **self.data}
        return {
            "lookups": int(d["lookups"]),
            "hit_chunks": int(d["hit_chunks"]),
            "lookup_chunks": int(d["lookup_chunks"]),
            "verified_chunks": int(d["verified_chunks"]),
            "unverified_chunks": int(d["unverified_chunks"]),
            "loaded_chunks": int(d["loaded_chunks"]),
            "loaded_MiB": round(d["loaded_bytes"] / 2**20, 1),
            "load_ms_avg": round(1000 * d["load_s"] / d["loads"], 2) if d["loads"] else 0.0,
            "stored_chunks": int(d["stored_chunks"]),
            "stored_MiB": round(d["stored_bytes"] / 2**20, 1),
            "save_ms_avg": round(1000 * d["save_s"] / d["saves"], 2) if d["saves"] else 0.0,
            "load_errors": int(d["load_errors"]),
            "unsalted_skipped": int(d["unsalted_skipped"]),
            "bad_salt_skipped": int(d["bad_salt_skipped"]),
            "short_prompts": int(d["short_prompts"]),
            "chose_recompute": int(d["chose_recompute"]),
            "loads_cut": int(d["loads_cut"]),
            "cache_off": int(d["cache_off"]),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in _SUMMED + _MAXED)

    def to_dict(self) -> dict[str, Any]:  # 0.26 has no to_dict; 0.32 sends this payload.
        return self.data


class KVHarborPromMetrics(KVConnectorPromMetrics):
    """Each summed stat as a counter ``vllm:kvharbor_<name>`` (Prometheus adds ``_total``),
    and ``vllm:kvharbor_cache_off`` as a gauge: 1 once the cache is off on some rank.

    The ``vllm:`` prefix is what ``LLM.get_metrics()`` collects.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM hands in its own metric classes (Ray's in a Ray deployment); typed loosely there.
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls
        self._counters = {
            name: self._per_engine(counter_cls(f"vllm:kvharbor_{name}", _HELP[name], labelnames=labelnames))
            for name in _SUMMED
        }
        gauge = gauge_cls(
            "vllm:kvharbor_cache_off",
            "1 when the external KV cache is off on some rank (the gateway failed); restart to turn it back on",
            labelnames=labelnames,
            multiprocess_mode="max",
        )
        self._cache_off = self._per_engine(gauge)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {engine: metric.labels(*values) for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counters in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counters[engine_idx].inc(value)
        if transfer_stats_data.get("cache_off"):
            self._cache_off[engine_idx].set(1)
