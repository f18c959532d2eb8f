"""Background probing: an unavailable tier comes back without a request reaching it.

A tier whose breaker opened (a card's target that stopped answering, a disk that
failed) is otherwise tried again only when a request reaches it; a gateway with no
traffic would never learn that the target came back, and its first request
afterwards would be a miss. `TierProber` is one daemon thread that wakes every
``storage.backpressure.circuit_breaker.background_probe_interval_s`` and calls
`kvharbor.cache.tier.Tier.probe` on every tier: a tier whose breaker is not due
a trial costs nothing (a look at its state); a due one gets the device probe
(`kvharbor.cache.probe`: one small object written, read back and deleted).
So the breaker's ``cooldown_s``, ``probe_backoff_factor`` and
``probe_interval_max_s`` still decide when a target is asked, and the log says
once each way that the tier is unavailable and that it answers again.

The same thread reads every tier's health each ``card.health_interval_s``
(`kvharbor.cache.tier.Tier.watch_health`), so a card that runs hot or a file
tier's filesystem that fills is said in the log once, as it happens, and not
only on a dashboard or a scrape.

Bounded: one thread, one probe per due tier per wake-up, each as long as the
device's own timeouts allow, and one health read per tier per health interval;
stopping it waits for the current round only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Self

from kvharbor.cache.breaker import BreakerState
from kvharbor.cache.tier import Tier
from kvharbor.periodic import Periodic
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway.prober")


class TierProber:
    def __init__(self, tiers: Sequence[Tier], interval_s: float, health_interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"background_probe_interval_s must be > 0, got {interval_s}")
        if health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {health_interval_s}")
        self.tiers = tuple(tiers)
        self.interval_s = interval_s
        self.health_interval_s = health_interval_s
        self.resumed = threading.Event()
        """Set once a probe closed a tier's breaker (the tier serves again): what a caller that
        waits for a tier's return (a test) waits on, instead of polling the breaker."""
        self._health_due_s = time.monotonic()
        self._periodic = Periodic("kvharbor-prober", interval_s, self._round)

    def start(self) -> Self:
        self._periodic.start()
        return self

    def stop(self) -> None:
        """Stop after the round in progress; safe to call twice, or before `start`."""
        self._periodic.stop()

    def probe_once(self) -> None:
        for tier in self.tiers:
            if self._periodic.stopping:
                return
            try:
                before = tier.breaker.state
                if tier.probe() is BreakerState.CLOSED and before is not BreakerState.CLOSED:
                    self.resumed.set()
            except Exception:  # A bug in one driver must not end probing for the others.
                _log.exception("kvharbor: tier %s: background probe failed unexpectedly", tier.name)

    def watch_health_once(self) -> None:
        for tier in self.tiers:
            if self._periodic.stopping:
                return
            try:
                tier.watch_health()
            except Exception:  # As above: one driver's bug must not end the watch of the others.
                _log.exception("kvharbor: tier %s: reading its health failed unexpectedly", tier.name)

    def _round(self) -> None:
        self.probe_once()
        if time.monotonic() >= self._health_due_s:
            self.watch_health_once()
            self._health_due_s = time.monotonic() + self.health_interval_s
