"""`Tier.probe` and the gateway's `TierProber`: a tier whose target went away comes back
with no request reaching it, through the breaker's own trial and backoff."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from kvharbor.cache.breaker import BreakerSettings, BreakerState, CircuitBreaker
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.tier import Tier
from kvharbor.gateway.prober import TierProber
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.params import CardParams

FINGERPRINT = LayoutFingerprint(model_id="test/probe", chunk_size=16).digest()
CAPACITY = 4 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def card_tier(clock: Clock | None = None, cooldown_s: float = 10.0) -> tuple[Tier, SimCardDevice]:
    device = SimCardDevice("card", CardParams(capacity_bytes=CAPACITY), max_value_bytes=1 << 20)
    settings = BreakerSettings(cooldown_s=cooldown_s, probe_backoff_factor=2.0, probe_interval_max_s=100.0)
    breaker = CircuitBreaker(settings, clock=clock) if clock else CircuitBreaker(settings)
    return Tier("card", device, MemoryIndex(), CAPACITY, breaker, device_type="nvme"), device


def test_a_probe_asks_only_when_due_backs_off_and_resumes_the_tier_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    tier, device = card_tier(clock)
    assert tier.probe() is BreakerState.CLOSED and tier.counters.errors == 0  # Nothing to ask.
    device.faults.target_down()
    assert not tier.write(os.urandom(16), FINGERPRINT, b"x" * 1000)  # Trips the breaker.
    assert tier.breaker.state is BreakerState.OPEN
    errors = tier.counters.errors
    assert tier.probe() is BreakerState.OPEN and tier.counters.errors == errors  # Not due: not asked.
    clock.now = 10.0
    assert tier.probe() is BreakerState.OPEN and tier.counters.errors == errors + 1  # Due, still down.
    assert tier.breaker.wait_s == 20.0, "a failed trial backs off by probe_backoff_factor"
    device.faults.target_up()
    clock.now = 29.0
    assert tier.probe() is BreakerState.OPEN  # Not due yet at the longer wait.
    clock.now = 30.0
    with caplog.at_level(logging.INFO, logger="kvharbor"):
        assert tier.probe() is BreakerState.CLOSED
        assert tier.probe() is BreakerState.CLOSED
    resumed = [m for m in (r.getMessage() for r in caplog.records) if "answers again" in m]
    # Said once, with the count of the times the tier was found unavailable again meanwhile.
    assert resumed == ["kvharbor: tier 'card' answers again; breaker closed (after 2 more time(s) since it was said)"]
    key = os.urandom(16)
    assert tier.write(key, FINGERPRINT, b"y" * 1000) and bytes(tier.read(key, FINGERPRINT) or b"") == b"y" * 1000


def test_a_full_card_answers_the_probe_and_a_dead_medium_does_not() -> None:
    clock = Clock()
    tier, device = card_tier(clock)
    device.faults.set_key_eviction(False)
    device.faults.target_down()
    assert not tier.write(os.urandom(16), FINGERPRINT, b"x" * 1000)
    device.faults.target_up()
    device.faults.fill(1.0)  # Back, but full: the probe's write is refused, yet the card answered.
    clock.now = 10.0
    assert tier.probe() is BreakerState.CLOSED
    assert 3002 in [event.code for event in device.card_events()], "the probe's write was refused as card full"


def test_the_prober_thread_resumes_a_tier_without_requests() -> None:
    tier, device = card_tier(cooldown_s=0.05)
    device.faults.target_down()
    assert not tier.write(os.urandom(16), FINGERPRINT, b"x" * 1000)
    device.faults.target_up()
    prober = TierProber([tier], interval_s=0.01, health_interval_s=10.0).start()
    try:
        assert prober.resumed.wait(30), "the prober never closed the breaker"
    finally:
        prober.stop()
    assert tier.breaker.state is BreakerState.CLOSED
    assert tier.counters.skipped == 0, "no request was needed"


def test_the_prober_refuses_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="background_probe_interval_s must be > 0"):
        TierProber([], 0, 10.0)
    with pytest.raises(ValueError, match="health_interval_s must be > 0"):
        TierProber([], 1.0, 0)


def test_each_change_of_a_tiers_health_is_said_once_a_lasting_state_is_not(caplog: pytest.LogCaptureFixture) -> None:
    tier, device = card_tier()
    prober = TierProber([tier], interval_s=1.0, health_interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="kvharbor"):
        prober.watch_health_once()  # Ok, as it started: nothing to say.
        device.faults.fail_supercap()
        prober.watch_health_once()
        prober.watch_health_once()
        device.faults.set_temperature(200.0)
        prober.watch_health_once()
        prober.watch_health_once()
        device.faults.repair_supercap()
        device.faults.set_temperature(40.0)
        prober.watch_health_once()
        prober.watch_health_once()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.WARNING, "kvharbor: tier 'card' health degraded: supercapacitor failed: writes not yet on flash "
         "are lost at a power loss"),
        (logging.ERROR, "kvharbor: tier 'card' health failed: temperature 200 C is critical"),
        (logging.INFO, "kvharbor: tier 'card' health ok again (was failed)"),
    ]  # fmt: skip


def test_the_prober_thread_says_a_health_change_without_requests() -> None:
    tier, device = card_tier()
    device.faults.fail_supercap()
    said = LineSeen("health degraded")
    logger = logging.getLogger("kvharbor")
    logger.addHandler(said)
    prober = TierProber([tier], interval_s=0.01, health_interval_s=0.01).start()
    try:
        assert said.wait(30), "the prober never said the card's health"
    finally:
        prober.stop()
        logger.removeHandler(said)


class LineSeen(logging.Handler):
    """Set once a log line containing ``text`` is emitted (by any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text
        self._seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self._seen.set()

    def wait(self, timeout_s: float) -> bool:
        return self._seen.wait(timeout_s)
