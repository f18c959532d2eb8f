"""The tiered store on RAM tiers: lookup, promotion, write policies, eviction, and faults.

Faults come from `FlakyDevice`, a real `RamDevice` that can be told to stop
answering: it exercises the fault path of the real tier and store code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import pytest

from kvharbor.cache import format as format_module
from kvharbor.cache.assembly import open_store
from kvharbor.cache.breaker import BreakerSettings, BreakerState, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.cache.store import TieredStore, WritePolicy
from kvharbor.cache.tier import Tier
from kvharbor.config import validate_config
from kvharbor.hal.base import Buffer, DeviceUnavailable
from kvharbor.hal.ram import RamDevice

FINGERPRINT = LayoutFingerprint(model_id="test/model", chunk_size=16).digest()
VALUE_BYTES = 1000
OBJECT_BYTES = HEADER_BYTES + VALUE_BYTES  # What one value costs a tier (codec none).


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FlakyDevice(RamDevice):
    """A RAM device that raises `DeviceUnavailable` on every call while ``failing``."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self.failing = False
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.failing:
            raise DeviceUnavailable(self.name, "target not answering")

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        self._check()
        super().put(key, parts)

    def get(self, key: bytes, into: memoryview) -> int | None:
        self._check()
        return super().get(key, into)

    def size(self, key: bytes) -> int | None:
        self._check()
        return super().size(key)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._check()
        return super().exists(keys)

    def delete(self, key: bytes) -> bool:
        self._check()
        return super().delete(key)


def make_tier(
    name: str,
    values: int = 100,
    device: RamDevice | None = None,
    breaker: BreakerSettings | None = None,
    clock: FakeClock | None = None,
) -> Tier:
    """A RAM tier whose budget (and device) hold ``values`` objects of `VALUE_BYTES`."""
    capacity = values * OBJECT_BYTES
    return Tier(
        name,
        device or RamDevice(name, capacity),
        MemoryIndex(),
        capacity,
        CircuitBreaker(breaker or BreakerSettings(), clock=clock or FakeClock()),
    )


def two_tiers(policy: WritePolicy = "write_through", upper: int = 100) -> TieredStore:
    return TieredStore([make_tier("ram", values=upper), make_tier("lower")], policy)


def new_key() -> ChunkKey:
    return ChunkKey(os.urandom(16))


def new_value() -> bytes:
    return os.urandom(VALUE_BYTES)


def read(store: TieredStore, key: bytes) -> bytes | None:
    value = store.get(key, FINGERPRINT)
    return None if value is None else bytes(value)


def held(tier: Tier, key: bytes) -> bool:
    """Both the index and the device hold ``key``."""
    return tier.index.get(key) is not None and tier.device.size(key) is not None


# ---- lookups and gets --------------------------------------------------------


def test_lookup_counts_leading_keys_found_in_any_tier() -> None:
    store = two_tiers()
    upper, lower = store.tiers
    keys = [new_key() for _ in range(6)]
    upper.write(keys[0], FINGERPRINT, new_value())
    lower.write(keys[1], FINGERPRINT, new_value())
    upper.write(keys[2], FINGERPRINT, new_value())
    lower.write(keys[2], FINGERPRINT, new_value())
    # keys[3] is nowhere; keys[4] is stored but past the first miss.
    upper.write(keys[4], FINGERPRINT, new_value())
    assert store.lookup(keys, chunk_tokens=256) == 3
    assert store.lookup(keys[3:]) == 0
    assert store.lookup([]) == 0
    totals = store.hits.snapshot()
    assert (totals.lookups, totals.lookup_tokens, totals.hit_tokens) == (2, 6 * 256, 3 * 256)


def test_get_finds_a_value_in_a_lower_tier_and_promotes_it() -> None:
    store = two_tiers()
    upper, lower = store.tiers
    key, value = new_key(), new_value()
    lower.write(key, FINGERPRINT, value)
    assert not held(upper, key)
    assert read(store, key) == value
    assert held(upper, key)
    lower_gets = lower.counters.gets
    assert read(store, key) == value  # Now served by the upper tier alone.
    assert lower.counters.gets == lower_gets
    assert upper.counters.hits == 1


def test_a_miss_everywhere_is_none() -> None:
    assert read(two_tiers(), new_key()) is None


def test_a_value_under_another_layout_is_a_miss() -> None:
    store = two_tiers()
    key = new_key()
    store.put(key, FINGERPRINT, new_value())
    other = LayoutFingerprint(model_id="test/other", chunk_size=16).digest()
    assert store.get(key, other) is None
    assert store.tiers[0].counters.corrupt == 1


# ---- write policies and eviction -------------------------------------------


def test_write_through_writes_every_tier() -> None:
    store = two_tiers("write_through")
    key, value = new_key(), new_value()
    assert store.put(key, FINGERPRINT, value)
    assert all(held(tier, key) for tier in store.tiers)


def test_a_put_with_its_checksum_known_stores_it_in_every_tier_without_hashing_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = two_tiers("write_through")
    key, value = new_key(), new_value()
    hashed: list[int] = []
    real = format_module.checksum

    def checksum(data: Buffer) -> int:
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(format_module, "checksum", checksum)
    assert store.put(key, FINGERPRINT, value, value_checksum=real(value))
    assert VALUE_BYTES not in hashed, "a tier hashed the value whose checksum it was given"
    for tier in store.tiers:
        assert bytes(tier.read(key, FINGERPRINT) or b"") == value, tier.name


def test_a_wrong_known_checksum_costs_its_value_a_miss_never_a_wrong_read() -> None:
    store = two_tiers("write_through")
    key, value = new_key(), new_value()
    assert store.put(key, FINGERPRINT, value, value_checksum=format_module.checksum(value) ^ 1)
    assert read(store, key) is None
    assert [tier.counters.corrupt for tier in store.tiers] == [1, 1]


def test_write_back_demotes_what_the_upper_tier_evicts() -> None:
    store = two_tiers("write_back", upper=2)
    upper, lower = store.tiers
    items = [(new_key(), new_value()) for _ in range(5)]
    for key, value in items[:2]:
        assert store.put(key, FINGERPRINT, value)
    assert lower.index.count() == 0  # Write-back: nothing below until something is evicted.
    for key, value in items[2:]:
        assert store.put(key, FINGERPRINT, value)
    assert [held(upper, k) for k, _ in items] == [False, False, False, True, True]
    assert [held(lower, k) for k, _ in items] == [True, True, True, False, False]
    assert upper.counters.evictions == 3
    for key, value in items:
        assert read(store, key) == value


def test_lru_eviction_keeps_the_budget_and_every_put_lands() -> None:
    tier = make_tier("ram", values=3)
    store = TieredStore([tier])
    a, b, c, d, e = (new_key() for _ in range(5))
    for key in (a, b, c):
        assert store.put(key, FINGERPRINT, new_value())
    assert read(store, a) is not None  # a is now the most recently used.
    assert store.put(d, FINGERPRINT, new_value())  # Evicts b, the least recently used.
    assert [held(tier, k) for k in (a, b, c, d)] == [True, False, True, True]
    assert store.put(e, FINGERPRINT, new_value())  # Evicts c.
    assert [held(tier, k) for k in (a, c, d, e)] == [True, False, True, True]
    assert tier.index.used_bytes() <= tier.capacity_bytes
    assert tier.device.usage().used_bytes <= tier.capacity_bytes
    assert (tier.counters.evictions, tier.counters.full) == (2, 0)


def test_a_value_larger_than_the_tier_is_not_stored_and_evicts_nothing() -> None:
    tier = make_tier("ram", values=2)
    store = TieredStore([tier])
    kept = new_key()
    store.put(kept, FINGERPRINT, new_value())
    assert not store.put(new_key(), FINGERPRINT, os.urandom(3 * OBJECT_BYTES))
    assert held(tier, kept) and tier.counters.evictions == 0


# ---- damage and faults ----------------------------------------------------------


def corrupt_in_place(tier: Tier, key: bytes) -> None:
    """Flip one payload byte inside the RAM device, as bit rot would."""
    stored = tier.device._values[key]  # type: ignore[attr-defined]
    stored[HEADER_BYTES + 7] ^= 0x20


def test_a_corrupt_object_is_a_counted_miss_and_is_dropped() -> None:
    tier = make_tier("ram")
    store = TieredStore([tier])
    key = new_key()
    store.put(key, FINGERPRINT, new_value())
    corrupt_in_place(tier, key)
    assert read(store, key) is None
    assert tier.counters.corrupt == 1
    assert tier.index.get(key) is None and tier.device.size(key) is None
    assert store.lookup([key]) == 0


def test_a_corrupt_upper_copy_falls_through_to_a_good_lower_copy() -> None:
    store = two_tiers("write_through")
    upper, lower = store.tiers
    key, value = new_key(), new_value()
    store.put(key, FINGERPRINT, value)
    corrupt_in_place(upper, key)
    assert read(store, key) == value
    assert (upper.counters.corrupt, lower.counters.hits) == (1, 1)
    # The good copy was promoted over the bad one: the upper tier serves it again.
    assert read(store, key) == value
    assert (upper.counters.hits, upper.counters.corrupt, lower.counters.hits) == (1, 1, 1)


BREAKER = BreakerSettings(failure_ratio=0.5, window=4, cooldown_s=60.0)


def flaky_store(clock: FakeClock) -> tuple[TieredStore, FlakyDevice]:
    device = FlakyDevice("flaky", 100 * OBJECT_BYTES)
    tier = make_tier("flaky", device=device, breaker=BREAKER, clock=clock)
    return TieredStore([tier, make_tier("lower")]), device


def test_a_failing_device_gives_misses_then_its_breaker_skips_it(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store, device = flaky_store(clock)
    flaky, lower = store.tiers
    items = [(new_key(), new_value()) for _ in range(8)]
    for key, value in items:
        store.put(key, FINGERPRINT, value)
    device.failing = True
    with caplog.at_level(logging.WARNING):
        for key, value in items[:4]:
            assert read(store, key) == value  # A miss in the sick tier, served from below.
    assert flaky.counters.errors > BREAKER.failure_ratio * BREAKER.window
    assert flaky.breaker.state is BreakerState.OPEN
    assert "tier 'flaky' circuit breaker open" in caplog.text
    assert caplog.text.count("tier 'flaky' read failed") == 1  # Said once, not per request.
    calls, skipped = device.calls, flaky.counters.skipped
    for key, value in items[4:]:
        assert read(store, key) == value
    assert store.put(new_key(), FINGERPRINT, new_value())
    assert flaky.contains([k for k, _ in items]) == [False] * 8
    assert device.calls == calls  # Skipped: the sick device was not asked at all.
    assert flaky.counters.skipped > skipped
    assert lower.counters.hits == 8


def test_a_store_whose_only_tier_fails_answers_misses_without_raising() -> None:
    device = FlakyDevice("flaky", 10 * OBJECT_BYTES)
    store = TieredStore([make_tier("flaky", device=device, breaker=BREAKER)])
    key = new_key()
    store.put(key, FINGERPRINT, new_value())
    device.failing = True
    assert read(store, key) is None
    assert not store.put(new_key(), FINGERPRINT, new_value())
    store.delete([key])


def cooled_down_breaker() -> tuple[TieredStore, Tier, bytes, bytes]:
    """A one-tier store whose breaker opened on failures and has just cooled down (half-open)."""
    clock = FakeClock()
    store, device = flaky_store(clock)
    flaky = store.tiers[0]
    key, value = new_key(), new_value()
    store.put(key, FINGERPRINT, value)
    device.failing = True
    for _ in range(4):
        store.get(key, FINGERPRINT)
    assert flaky.breaker.state is BreakerState.OPEN
    device.failing = False
    clock.now += BREAKER.cooldown_s
    return store, flaky, key, value


def test_the_tier_comes_back_after_the_cooldown() -> None:
    store, flaky, key, value = cooled_down_breaker()
    hits = flaky.counters.hits
    assert read(store, key) == value  # The half-open trial, served by the flaky tier.
    assert flaky.counters.hits == hits + 1
    assert flaky.breaker.state is BreakerState.CLOSED


def test_an_unstorable_write_does_not_wedge_a_half_open_breaker() -> None:
    _, flaky, key, _ = cooled_down_breaker()
    # The trial is taken by a write too large for the tier; it never reaches the device.
    assert not flaky.write(new_key(), FINGERPRINT, os.urandom(200 * OBJECT_BYTES))
    assert flaky.read(key, FINGERPRINT) is not None  # The next operation may still try.
    assert flaky.breaker.state is BreakerState.CLOSED


# ---- start-up -------------------------------------------------------------------


def test_clear_empties_every_tier() -> None:
    store = two_tiers()
    keys = [new_key() for _ in range(3)]
    for key in keys:
        store.put(key, FINGERPRINT, new_value())
    assert store.clear() == 6  # Three objects in each of two tiers.
    assert store.lookup(keys) == 0
    assert all(tier.device.usage().keys == 0 and tier.index.count() == 0 for tier in store.tiers)


def _ram_tiers_config(*tiers: tuple[str, float]) -> dict[str, object]:
    tiers_section = [{"name": n, "type": "ram", "capacity_gb": gb} for n, gb in tiers]
    return {"storage": {"tiers": tiers_section, "fallback_path": None}}


def test_open_store_skips_a_tier_that_fails_its_probe(caplog: pytest.LogCaptureFixture) -> None:
    # ~5 KB: room for a header, too small to hold the 4 KiB probe object's, so its write
    # fails for real.
    config = validate_config(_ram_tiers_config(("tiny", 5e-6), ("ram", 0.01)))
    with caplog.at_level(logging.INFO):
        store = open_store(config)
    assert [t.name for t in store.tiers] == ["ram"]
    assert "tier tiny failed its startup probe" in caplog.text
    key, value = new_key(), new_value()
    assert store.put(key, FINGERPRINT, value) and read(store, key) == value


def test_a_store_with_no_usable_tier_is_all_misses(caplog: pytest.LogCaptureFixture) -> None:
    config = validate_config(_ram_tiers_config(("tiny", 1e-6)))
    with caplog.at_level(logging.WARNING):
        store = open_store(config)
    assert store.tiers == []
    assert "no usable storage tier" in caplog.text
    key = new_key()
    assert not store.put(key, FINGERPRINT, new_value())
    assert store.lookup([key]) == 0 and read(store, key) is None


def test_open_store_start_clean_empties_the_tiers() -> None:
    config = validate_config(_ram_tiers_config(("ram", 0.01)))
    store = open_store(config, start_clean=True)
    assert store.tiers[0].index.count() == 0 and store.tiers[0].device.usage().keys == 0
