"""Gauges read from the live objects at scrape time: tiers, cards, the RAM refill.

A gauge set by hand goes stale the moment its owner forgets one path; these are
read when ``/metrics`` is scraped, so they say what is true then. Reading must
stay cheap at any scrape rate: a tier's usage and breaker come from memory (its
index and breaker), and whatever a card answers only through a device command
(its health, its status: nvme-cli runs, an Identify) is read at most once per
``card.health_interval_s`` (`Reused`), never once per scrape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvharbor.cache.breaker import BreakerState
from kvharbor.hal.base import CapacityUsage, CardDevice, CardStatus, DeviceError, Health, HealthState

if TYPE_CHECKING:
    from kvharbor.cache.refill import RamRefill
    from kvharbor.cache.tier import Tier

T = TypeVar("T")

CAPACITY_USAGE_LEVELS = {CapacityUsage.OK: 0, CapacityUsage.WARNING: 1, CapacityUsage.CRITICAL: 2}
"""``kvharbor_card_capacity_usage_level``: a card's `CapacityUsage` as a number, CRITICAL highest."""


@dataclass(frozen=True, slots=True)
class _Reading(Generic[T]):
    value: T | None
    """None: the read failed (the failure is reused as well: a failing card is not asked per scrape)."""
    at_s: float


class Reused(Generic[T]):
    """A value read at most once per ``interval_s``; thread-safe (scrapes run on server threads)."""

    def __init__(self, read: Callable[[], T], interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._read = read
        self._interval_s = interval_s
        self._clock = clock
        self._last: _Reading[T] | None = None
        self._lock = threading.Lock()

    def get(self) -> T | None:
        """The last reading if younger than the interval, else a fresh one; None when the
        read raised `DeviceError`."""
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last.at_s >= self._interval_s:
                try:
                    value: T | None = self._read()
                except DeviceError:
                    value = None
                self._last = _Reading(value, now)
            return self._last.value


class _TierReader:
    """One tier's state for a scrape; a card's health and status are `Reused`."""

    def __init__(self, tier: Tier, card_interval_s: float) -> None:
        self.tier = tier
        device = tier.device
        self.card: Reused[CardStatus] | None = None
        self.health: Callable[[], Health | None] = device.health
        if isinstance(device, CardDevice):
            self.card = Reused(device.card_status, card_interval_s)
            self.health = Reused(device.health, card_interval_s).get


class StoreCollector(Collector):
    """``kvharbor_tier_{used_bytes,allocated_bytes,capacity_bytes,objects,breaker_open,up}{tier}``, the
    ``kvharbor_card_*{tier}`` gauges of card tiers, and ``kvharbor_refill_bytes_total``."""

    def __init__(self, tiers: Sequence[Tier], refill: RamRefill | None, card_interval_s: float) -> None:
        self._tiers = [_TierReader(tier, card_interval_s) for tier in tiers]
        self._refill = refill

    def describe(self) -> Iterable[Metric]:
        """The families' names without reading anything (asked at registration)."""
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        f = _Families()
        for reader in self._tiers:
            tier, labels = reader.tier, [reader.tier.name]
            usage = tier.usage()
            if usage.used_bytes >= 0:  # Else its index failed (counted as a fault): no reading.
                f.used.add_metric(labels, usage.used_bytes)
                f.allocated.add_metric(labels, usage.allocated_bytes)
                f.objects.add_metric(labels, usage.keys)
            f.capacity.add_metric(labels, tier.capacity_bytes)
            f.breaker_open.add_metric(labels, int(tier.breaker.state is BreakerState.OPEN))
            health = reader.health()
            f.up.add_metric(labels, int(health is not None and health.state is not HealthState.FAILED))
            card = reader.card.get() if reader.card is not None else None
            if card is not None:
                f.temperature.add_metric(labels, card.temperature_c)
                f.supercap_ok.add_metric(labels, int(card.supercap == "ok"))
                f.usage_level.add_metric(labels, CAPACITY_USAGE_LEVELS[card.capacity_usage])
        if self._refill is not None:
            f.refill_bytes.add_metric([], self._refill.status().bytes)
        return f.all()


_TIER = ["tier"]


@dataclass(frozen=True)
class _Families:
    """One scrape's families, empty until filled."""

    used: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily("kvharbor_tier_used_bytes", "Bytes the tier uses", labels=_TIER)
    )
    allocated: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "kvharbor_tier_allocated_bytes",
            "Bytes the tier's objects take on its device (whole pages, slab slots): what its budget counts",
            labels=_TIER,
        )
    )
    capacity: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily("kvharbor_tier_capacity_bytes", "The tier's capacity", labels=_TIER)
    )
    objects: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily("kvharbor_tier_objects", "Objects the tier stores", labels=_TIER)
    )
    breaker_open: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "kvharbor_tier_breaker_open", "1 while the tier's breaker is open", labels=_TIER
        )
    )
    up: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "kvharbor_tier_up", "1 when the tier's device is healthy (ok or degraded), 0 failed", labels=_TIER
        )
    )
    temperature: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "kvharbor_card_temperature_celsius", "The card's temperature", labels=_TIER
        )
    )
    supercap_ok: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "kvharbor_card_supercap_ok", "1 when the card's supercapacitor is ok, 0 failed", labels=_TIER
        )
    )
    usage_level: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "kvharbor_card_capacity_usage_level", "The card's CapacityUsage: 0 OK, 1 WARNING, 2 CRITICAL", labels=_TIER
        )
    )
    refill_bytes: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily("kvharbor_refill_bytes", "Value bytes the RAM refill copied")
    )

    def all(self) -> list[Metric]:
        return [getattr(self, f.name) for f in fields(self)]
