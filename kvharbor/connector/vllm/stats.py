"""kvharbor's numbers in vLLM's connector stats: what was looked up, moved and skipped, and how long it took.

Workers (loads, saves) and the scheduler (lookups, skipped requests) collect
them per step; vLLM aggregates them across workers, logs
``KV Transfer metrics: ...`` every stats interval and hands each step's
numbers to `KVHarborPromMetrics`, which keeps them as ``vllm:kvharbor_*``
series on ``/metrics`` (and in ``LLM.get_metrics()``). What the stats are, how
they merge and show, is `kvharbor.telemetry.engine_stats.ENGINE_STATS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvharbor.telemetry.engine_stats import BY_NAME, ENGINE_STATS, PREFIX, EngineStat, Merge, Shown

_SUMMED = tuple(stat.name for stat in ENGINE_STATS if stat.merge is Merge.SUM)
_MAXED = tuple(stat.name for stat in ENGINE_STATS if stat.merge is Merge.MAX)


def empty() -> dict[str, float]:
    return dict.fromkeys(BY_NAME, 0)


def _shown(stat: EngineStat, d: dict[str, float]) -> int | float:
    """One stat's figure in the log line (see `Shown`)."""
    if stat.shown is Shown.MIB:
        return round(d[stat.name] / 2**20, 1)
    if stat.shown is Shown.MS_AVERAGE:
        return round(1000 * d[stat.name] / d[stat.per], 2) if d[stat.per] else 0.0
    return int(d[stat.name])


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
        return {stat.shown_as: _shown(stat, d) for stat in ENGINE_STATS if stat.shown is not Shown.HIDDEN}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in _SUMMED + _MAXED)

    def to_dict(self) -> dict[str, Any]:  # 0.26 has no to_dict; 0.32 sends this payload.
        return self.data


class KVHarborPromMetrics(KVConnectorPromMetrics):
    """Each exported stat of `ENGINE_STATS` as a series in vLLM's registry: a summed
    one as a counter ``vllm:kvharbor_<name>_total``, a maxed one (``cache_off``: 1 once
    the cache is off on some rank) as a gauge ``vllm:kvharbor_<name>``.

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
        exported = [stat for stat in ENGINE_STATS if stat.exported]
        # prometheus-client adds ``_total`` to a counter's name.
        self._counters = {
            stat.name: self._per_engine(counter_cls(f"{PREFIX}{stat.name}", stat.help, labelnames=labelnames))
            for stat in exported
            if stat.merge is Merge.SUM
        }
        self._gauges = {
            stat.name: self._per_engine(
                gauge_cls(stat.series, stat.help, labelnames=labelnames, multiprocess_mode="max")
            )
            for stat in exported
            if stat.merge is Merge.MAX
        }

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {engine: metric.labels(*values) for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counters in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counters[engine_idx].inc(value)
        for name, gauges in self._gauges.items():
            # A state reached is kept: a later step without the flag does not clear it
            # (the cache stays off on that rank until a restart).
            if transfer_stats_data.get(name):
                gauges[engine_idx].set(1)
