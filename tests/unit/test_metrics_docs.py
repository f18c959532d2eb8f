"""docs/metrics.md and the registries name the same metrics, of the same types and labels;
a card's readings are reused within their interval (no device command per scrape)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

from kvharbor.gateway.collectors import Reused
from kvharbor.hal.base import DeviceError
from kvharbor.telemetry.engine_stats import ENGINE_STATS, Merge
from tests.support.metrics_docs import Described, documented
from tests.support.real_gateway import RealGateway


def registered(families: list[Metric]) -> Described:
    """Names as scraped (a counter's with ``_total``); labels from its samples (none: unknown, empty)."""
    described: Described = {}
    for family in families:
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = frozenset(key for sample in family.samples for key in sample.labels if key != "le")
        described[name] = (family.type, labels)
    return described


def test_every_gateway_metric_is_documented_and_every_documented_one_registered(tmp_path: Path) -> None:
    gateway = RealGateway(tmp_path / "gateway").start()
    try:
        gateway.holds([bytes(16)])  # A request: the per-type series exist from the first one.
        assert gateway.server is not None
        families = list(gateway.server.metrics.registry.collect())
    finally:
        gateway.close()
    docs, found = documented("kvharbor_"), registered(families)
    assert sorted(found) == sorted(docs)
    for name, (kind, labels) in found.items():
        assert kind == docs[name][0], name
        assert not labels or labels == docs[name][1], name  # Families without samples yet say nothing.


def test_every_engine_stat_is_documented_and_is_what_vllm_registers() -> None:
    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    labels = ["model_name", "engine"]
    from kvharbor.connector.vllm.stats import KVHarborPromMetrics

    KVHarborPromMetrics(SimpleNamespace(kv_transfer_config=None), types, labels, {0: ["tiny", "0"]})
    found = registered(list(registry.collect()))
    table = {
        stat.series: ("counter" if stat.merge is Merge.SUM else "gauge", frozenset(labels))
        for stat in ENGINE_STATS
        if stat.exported
    }
    assert found == table == documented("vllm:kvharbor_")


def test_a_reading_is_reused_within_its_interval_and_a_failure_too() -> None:
    now = [0.0]
    reads: list[int] = []

    def read() -> int:
        reads.append(1)
        if len(reads) == 2:
            raise DeviceError("card", "nvme-cli failed")
        return len(reads)

    reading = Reused(read, 10.0, clock=lambda: now[0])
    assert [reading.get() for _ in range(50)] == [1] * 50 and len(reads) == 1
    now[0] = 10.0
    assert reading.get() is None and reading.get() is None and len(reads) == 2, "a failing card is not asked again"
    now[0] = 20.0
    assert reading.get() == 3
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        Reused(read, 0)
