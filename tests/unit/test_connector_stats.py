"""Connector stats: summed across workers and steps, the cache-off state kept, and shown as Prometheus series."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvharbor.connector.vllm.stats import KVHarborPromMetrics, KVHarborStats, empty
from kvharbor.telemetry.engine_stats import check_names


def stats(**values: float) -> KVHarborStats:
    return KVHarborStats(data={**empty(), **values})


def test_workers_sum_and_a_cache_off_anywhere_shows() -> None:
    total = stats(loaded_chunks=3, loaded_bytes=3 << 20, load_seconds=0.5, loads=1)
    total.aggregate(stats(loaded_chunks=2, loaded_bytes=2 << 20, load_seconds=0.5, loads=1, cache_off=1))
    total.aggregate(stats(stored_chunks=4, cache_off=0))
    reduced = total.reduce()
    assert reduced["loaded_chunks"] == 5 and reduced["loaded_MiB"] == 5.0
    assert reduced["load_ms_avg"] == 500.0
    assert reduced["stored_chunks"] == 4
    assert reduced["cache_off"] == 1


def test_empty_is_empty_and_reset_empties() -> None:
    assert KVHarborStats(data={}).is_empty()
    assert not stats(cache_off=1).is_empty()
    busy = stats(lookups=1)
    busy.reset()
    assert busy.is_empty()


def test_payload_survives_the_trip_to_the_front_end() -> None:
    sent = stats(hit_chunks=7, unsalted_skipped=1).to_dict()
    rebuilt = KVHarborStats(data=dict(sent))
    assert rebuilt.reduce()["hit_chunks"] == 7 and rebuilt.reduce()["unsalted_skipped"] == 1


def test_prometheus_series_count_each_step_and_hold_cache_off() -> None:
    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    labels = {"model_name": "tiny", "engine": "0"}
    engine = SimpleNamespace(kv_transfer_config=None)
    metrics = KVHarborPromMetrics(engine, types, list(labels), {0: list(labels.values())})

    metrics.observe(stats(loaded_chunks=3, lookups=1).to_dict(), 0)
    metrics.observe(stats(loaded_chunks=2).to_dict(), 0)
    assert registry.get_sample_value("vllm:kvharbor_loaded_chunks_total", labels) == 5
    assert registry.get_sample_value("vllm:kvharbor_lookups_total", labels) == 1
    assert registry.get_sample_value("vllm:kvharbor_cache_off", labels) == 0
    metrics.observe(stats(cache_off=1).to_dict(), 0)
    metrics.observe(stats(stored_chunks=1).to_dict(), 0)  # A later step without the flag keeps it.
    assert registry.get_sample_value("vllm:kvharbor_cache_off", labels) == 1


def test_a_counter_feeding_the_stats_with_a_name_the_table_lacks_is_refused() -> None:
    check_names(["lookups", "load_seconds"], "a counter")  # Known names pass.
    with pytest.raises(ValueError, match="a counter counts load_s, not in"):
        check_names(["lookups", "load_s"], "a counter")
