"""The card as a tier: configured as ``type: nvme``, opened with the card settings, degrading cleanly.

Every test runs the real tier, store and assembly over a real `SimCardDevice`
(on virtual time, or scaled real time where the assembly opens it itself).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvharbor.cache.assembly import open_store, open_tier
from kvharbor.cache.breaker import BreakerSettings, BreakerState, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import LayoutFingerprint, card_layout, tier_fingerprint
from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Tier
from kvharbor.config import ConfigError, NvmeTierSection, validate_config
from kvharbor.hal.ram import RamDevice
from kvharbor.hal.sim.clock import VirtualClock
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.params import CardParams

FINGERPRINT = LayoutFingerprint(model_id="test/card", chunk_size=16).digest()
VALUE_BYTES = 16 * 1024
PARAMS = CardParams(capacity_bytes=16 * VALUE_BYTES, value_bytes_max=4 * VALUE_BYTES)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def card_config(**card: object) -> dict[str, object]:
    return {
        "storage": {
            "tiers": [
                {"name": "ram", "type": "ram", "capacity_gb": 0.001},
                {"name": "card", "type": "nvme", "device": "sim"},
            ],
            "fallback_path": None,  # A skipped card leaves RAM alone, no fallback tier.
        },
        "card": card,
    }


def sim_device() -> SimCardDevice:
    return SimCardDevice("card", PARAMS, VirtualClock())


def card_tier(device: SimCardDevice, config: dict[str, object] | None = None) -> Tier:
    validated = validate_config(config or card_config())
    section = validated.storage.tiers[1]
    return open_tier(section, validated, device)


def value() -> bytes:
    return os.urandom(VALUE_BYTES)


# -- configuration -----------------------------------------------------------


def test_a_card_tier_needs_no_capacity_and_takes_the_devices() -> None:
    config = validate_config(card_config())
    section = config.storage.tiers[1]
    assert isinstance(section, NvmeTierSection) and section.capacity_gb is None
    tier = card_tier(sim_device())
    assert tier.capacity_bytes == PARAMS.capacity_bytes


@pytest.mark.parametrize(
    ("tier", "named"),
    [
        ({"name": "card", "type": "nvme", "device": "ng0n1"}, "device: expected sim, sim:PARAMS.yaml"),
        ({"name": "card", "type": "nvme", "device": "sim", "capacity_gb": 0}, "capacity_gb"),
    ],
)
def test_a_bad_card_tier_is_refused_naming_the_key(tier: dict[str, object], named: str) -> None:
    # A missing device is not refused: the tier is skipped naming it (tests/unit/test_tier_config.py).
    with pytest.raises(ConfigError, match=named):
        validate_config({"storage": {"tiers": [tier]}})


def test_more_than_one_card_tier_is_refused() -> None:
    cards = [{"name": n, "type": "nvme", "device": "sim"} for n in ("a", "b")]
    with pytest.raises(ConfigError, match="at most one nvme"):
        validate_config({"storage": {"tiers": cards}})


@pytest.mark.parametrize(
    ("tier", "said"),
    [
        ({"device": "sim", "capacity_gb": 2}, "exceeds the device's capacity"),
        ({"device": "file:/nonexistent/card.img"}, "card.img does not exist; set the tier's capacity_gb"),
        ({"device": "/dev/ng97n1"}, "device /dev/ng97n1 does not exist"),
        ({"device": "sim:/nonexistent/card.yaml"}, "sim parameter file /nonexistent/card.yaml"),
    ],
)
def test_a_card_that_cannot_open_is_skipped_and_the_others_serve(
    tier: dict[str, object], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = validate_config(
        {
            "storage": {
                "tiers": [
                    {"name": "ram", "type": "ram", "capacity_gb": 0.001},
                    {"name": "card", "type": "nvme", **tier},
                ],
                "fallback_path": None,
            }
        }
    )
    with caplog.at_level(logging.WARNING):
        store = open_store(config)
    assert [t.name for t in store.tiers] == ["ram"]
    assert "tier card unavailable: tier 'card'" in caplog.text and said in caplog.text


def test_a_bad_parameter_file_names_its_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    params = tmp_path / "card.yaml"
    params.write_text("channel: 4\n")
    tiers = [{"name": "card", "type": "nvme", "device": f"sim:{params}"}]
    config = validate_config({"storage": {"tiers": tiers, "fallback_path": None}})
    with caplog.at_level(logging.WARNING):
        store = open_store(config)
    assert store.tiers == []
    assert "unknown key 'channel'" in caplog.text


# -- the card settings -------------------------------------------------------


def test_the_fragment_size_is_the_devices_largest_object_and_splits_values() -> None:
    device = SimCardDevice(
        "card", CardParams(capacity_bytes=1 << 24), VirtualClock(), max_value_bytes=8192 + HEADER_BYTES
    )
    tier = card_tier(device, card_config(fragment_bytes=8192))
    assert device.max_value_bytes == 8192 + HEADER_BYTES
    key = os.urandom(16)
    assert tier.write(key, FINGERPRINT, os.urandom(3 * 8192 + 1))  # Three fragments and a byte.
    assert tier.index.get(key).parts == 4  # type: ignore[union-attr]
    assert tier.layout == card_layout(device.max_value_bytes)


def test_a_changed_card_layout_makes_card_objects_misses_and_no_other_tiers(caplog: pytest.LogCaptureFixture) -> None:
    device = sim_device()
    ram = Tier("ram", RamDevice("ram", 1 << 20), MemoryIndex(), 1 << 20, CircuitBreaker(BreakerSettings()))
    before = Tier(
        "card",
        device,
        MemoryIndex(),
        PARAMS.capacity_bytes,
        CircuitBreaker(BreakerSettings()),
        layout=card_layout(1 << 20),
    )
    key, data = os.urandom(16), value()
    assert ram.write(key, FINGERPRINT, data) and before.write(key, FINGERPRINT, data)
    after = Tier(
        "card",
        device,
        MemoryIndex(),
        PARAMS.capacity_bytes,
        CircuitBreaker(BreakerSettings()),
        layout=card_layout(2 << 20),
    )
    after.index.admit(before.index.get(key), PARAMS.capacity_bytes)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert after.read(key, FINGERPRINT) is None
        assert after.read(key, FINGERPRINT) is None
    assert (after.counters.stale, after.counters.corrupt) == (1, 0)
    assert caplog.text.count("stored under other settings") == 1 and "corrupt" not in caplog.text
    assert bytes(ram.read(key, FINGERPRINT) or b"") == data, "the RAM hit is untouched"
    assert device.exists([key]) == [False], "the stale object was dropped"


def test_objects_are_counted_per_engine_layout_through_evictions_and_a_card_tiers_own_layout() -> None:
    other = LayoutFingerprint(model_id="test/card", chunk_size=32).digest()
    ram = Tier(
        "ram",
        RamDevice("ram", 1 << 20),
        MemoryIndex(),
        3 * (HEADER_BYTES + VALUE_BYTES),
        CircuitBreaker(BreakerSettings()),
    )
    for fingerprint in (FINGERPRINT, FINGERPRINT, other, other):  # The fourth evicts the first.
        assert ram.write(os.urandom(16), fingerprint, value())
    assert ram.counters.evictions == 1
    assert ram.layout_counts() == {FINGERPRINT.hex(): 1, other.hex(): 2}
    layout = card_layout(1 << 20)
    device = sim_device()
    card = Tier("card", device, MemoryIndex(), PARAMS.capacity_bytes, CircuitBreaker(BreakerSettings()), layout=layout)
    for fingerprint in (FINGERPRINT, FINGERPRINT, other):
        assert card.write(os.urandom(16), fingerprint, value())
    assert card.layout_counts() == {FINGERPRINT.hex(): 2, other.hex(): 1}, "named by the engine's digest"
    # Another process over what the card holds has seen no engine yet: the stored digests...
    again = Tier("card", device, card.index, PARAMS.capacity_bytes, CircuitBreaker(BreakerSettings()), layout=layout)
    assert again.layout_counts() == {
        tier_fingerprint(FINGERPRINT, layout).hex(): 2,
        tier_fingerprint(other, layout).hex(): 1,
    }
    again.learn_engine_fingerprints([FINGERPRINT])  # ...until the gateway teaches it a registered layout.
    assert again.layout_counts() == {FINGERPRINT.hex(): 2, tier_fingerprint(other, layout).hex(): 1}


def test_key_eviction_off_refuses_when_full_and_the_store_keeps_serving() -> None:
    device = sim_device()
    tier = card_tier(device, card_config(key_eviction=False))
    assert device.card.key_eviction is False and tier.device_evicts is False
    ram = Tier("ram", RamDevice("ram", 1 << 22), MemoryIndex(), 1 << 22, CircuitBreaker(BreakerSettings()))
    store = TieredStore([ram, tier], "write_through")
    device.faults.fill(1.0)
    key, data = os.urandom(16), value()
    assert store.put(key, FINGERPRINT, data), "stored in RAM"
    assert tier.counters.full == 1 and tier.breaker.state is BreakerState.CLOSED
    assert bytes(store.get(key, FINGERPRINT) or b"") == data
    assert 3002 in [e.code for e in device.card_events()]


def test_with_key_eviction_on_the_card_says_what_it_holds() -> None:
    device = sim_device()
    tier = card_tier(device, card_config(key_eviction=True))
    assert tier.device_evicts
    keys = [os.urandom(16) for _ in range(4)]
    for key in keys:
        assert tier.write(key, FINGERPRINT, value())
    device.faults.fill(1.0)  # Full, of values the index does not know of.
    later = [os.urandom(16) for _ in range(4)]
    for key in later:  # The card evicts the oldest values, the first four, to make room.
        assert tier.write(key, FINGERPRINT, value()), "with key eviction on the card keeps accepting writes"
    assert tier.contains(keys + later) == [False] * 4 + [True] * 4
    assert tier.index.count() == 4, "evicted keys leave the index"
    assert tier.read(keys[0], FINGERPRINT) is None
    assert device.card.counts["evicted_keys"] >= 4


def test_an_unreachable_target_makes_the_tier_unavailable_then_it_resumes(caplog: pytest.LogCaptureFixture) -> None:
    device, clock = sim_device(), Clock()
    breaker = CircuitBreaker(
        BreakerSettings(cooldown_s=10.0, probe_backoff_factor=2.0, probe_interval_max_s=100.0), clock
    )
    tier = Tier(
        "card",
        device,
        MemoryIndex(),
        PARAMS.capacity_bytes,
        breaker,
        layout=card_layout(device.max_value_bytes),
        device_evicts=True,
    )
    ram = Tier("ram", RamDevice("ram", 1 << 22), MemoryIndex(), 1 << 22, CircuitBreaker(BreakerSettings()))
    store = TieredStore([ram, tier], "write_through")
    key, data = os.urandom(16), value()
    assert store.put(key, FINGERPRINT, data)
    device.faults.target_down()
    with caplog.at_level(logging.INFO):
        assert tier.read(key, FINGERPRINT) is None
        assert tier.breaker.state is BreakerState.OPEN, "at once, not after a window of failures"
        assert bytes(store.get(key, FINGERPRINT) or b"") == data, "RAM serves"
        assert store.put(os.urandom(16), FINGERPRINT, value())
        clock.now += 10.0
        assert tier.read(key, FINGERPRINT) is None  # The trial: still down; the next wait doubles.
        clock.now += 10.0
        assert tier.breaker.state is BreakerState.OPEN
        device.faults.target_up()
        clock.now += 10.0
        assert bytes(tier.read(key, FINGERPRINT) or b"") == data
    assert tier.breaker.state is BreakerState.CLOSED
    assert caplog.text.count("tier 'card' unavailable") == 1
    assert caplog.text.count("tier 'card' answers again") == 1
    assert device.status_counts()["3/70h"] == 2
