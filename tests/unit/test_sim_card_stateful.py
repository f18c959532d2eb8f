"""The simulated card under any sequence of operations and faults never serves wrong bytes.

A hypothesis state machine drives a real `SimCardDevice` on virtual time: puts,
deletes, fills, key eviction switched on and off, power cycles with a healthy or
failed supercapacitor, the remote target down and up, time passing. Beside it
runs `CardModel`, the card's documented rules (`kvharbor.hal.sim.card`) written
out plainly: values in write order, the oldest evicted first when key eviction
is on, card full (and one event 3002 per episode) when it is off, writes not yet
on flash lost at a power loss only with a failed supercapacitor. After every
step each key reads back exactly what the model holds (its bytes, or a miss),
and usage agrees: a value that vanishes, comes back, or is stale is caught at
the step that caused it.

The machine is proven to catch bugs: each test at the end plants one realistic
bug in the card and asserts that the machine finds it within a fixed budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvharbor.hal.base import CapacityUsage, DeviceFull, TargetUnreachable
from kvharbor.hal.sim.card import FILL_KEY_PREFIX, SimCard, Stored
from kvharbor.hal.sim.clock import VirtualClock
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.events import CardEventCode
from kvharbor.hal.sim.params import CardParams

VALUE_BYTES_MAX = 4096
PARAMS = CardParams(
    capacity_bytes=4 * VALUE_BYTES_MAX, keys_max=6, value_bytes_max=VALUE_BYTES_MAX, persist_delay_s=0.001
)
KEY_SPACE = [n.to_bytes(16, "big") for n in range(6)]
KEYS = st.sampled_from(KEY_SPACE)
KEY_A, KEY_B = b"a" * 16, b"b" * 16


class CardModel:
    """What the card must hold: its rules, plainly, with none of its bookkeeping for speed."""

    def __init__(self, params: CardParams) -> None:
        self.params = params
        self.values: OrderedDict[bytes, bytes] = OrderedDict()
        """Oldest written first."""
        self.unflushed: list[tuple[float, bytes, bytes]] = []
        """(on flash at, key, value) since the last power cycle."""
        self.key_eviction = params.key_eviction
        self.supercap_ok = True
        self.full_said = False
        self.filled = 0

    @property
    def used_bytes(self) -> int:
        return sum(len(v) for v in self.values.values())

    def store(self, key: bytes, value: bytes, now: float) -> bool:
        """False: refused as card full (the model is unchanged)."""
        others = [(k, v) for k, v in self.values.items() if k != key]
        if not self._fits(others, len(value)):
            if not self.key_eviction:
                self.full_said = True
                return False
            while others and not self._fits(others, len(value)):
                others.pop(0)
        self.values = OrderedDict([*others, (key, value)])
        self.unflushed.append((now + self.params.persist_delay_s, key, value))
        self.full_said = False
        return True

    def fill(self, ratio: float, now: float) -> int:
        target = int(ratio * self.params.capacity_bytes)
        stored = 0
        while self.used_bytes < target:
            before = self.used_bytes
            key = FILL_KEY_PREFIX + (self.filled + stored).to_bytes(16 - len(FILL_KEY_PREFIX), "big")
            if not self.store(key, bytes(min(self.params.value_bytes_max, target - before)), now):
                break
            stored += 1
            if self.used_bytes <= before:
                break
        self.filled += stored
        return stored

    def power_cycle(self, now: float) -> int:
        lost = 0
        if not self.supercap_ok:
            for on_flash_s, key, value in self.unflushed:
                if on_flash_s > now and self.values.get(key) is value:
                    del self.values[key]
                    lost += 1
        self.unflushed = []
        return lost

    def _fits(self, others: list[tuple[bytes, bytes]], nbytes: int) -> bool:
        used = sum(len(v) for _, v in others) + nbytes
        return used <= self.params.capacity_bytes and len(others) + 1 <= self.params.keys_max


class SimCardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.device = SimCardDevice("card", PARAMS, VirtualClock())
        self.card = self.device.card
        self.model = CardModel(PARAMS)
        self.target_up = True
        self.serial = 0

    @initialize(enabled=st.booleans())
    def start_with_key_eviction(self, enabled: bool) -> None:
        self.device.faults.set_key_eviction(enabled)
        self.model.key_eviction = enabled

    def now(self) -> float:
        return self.card.clock.now()

    def full_events(self) -> int:
        return [e.code for e in self.device.card_events()].count(CardEventCode.CARD_FULL)

    # -- operations --------------------------------------------------------------

    @rule(key=KEYS, size=st.integers(0, VALUE_BYTES_MAX))
    def put(self, key: bytes, size: int) -> None:
        self.serial += 1
        value = self.serial.to_bytes(4, "big") * (size // 4) + b"\x5a" * (size % 4)
        parts = [value[: size // 2], value[size // 2 :]]
        if not self.target_up:
            with pytest.raises(TargetUnreachable):
                self.device.put(key, parts)
            return
        events, new_episode = self.full_events(), not self.model.full_said
        if self.model.store(key, value, self.now()):
            self.device.put(key, parts)
            return
        with pytest.raises(DeviceFull):
            self.device.put(key, parts)
        assert self.card.capacity_usage is CapacityUsage.CRITICAL
        assert self.full_events() == events + new_episode, "one event 3002 per full episode"

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        if not self.target_up:
            with pytest.raises(TargetUnreachable):
                self.device.delete(key)
            return
        assert self.device.delete(key) == (self.model.values.pop(key, None) is not None)

    # -- faults and operator actions -----------------------------------------------

    @rule(ratio=st.sampled_from([0.5, 0.9, 1.0]))
    def fill(self, ratio: float) -> None:
        expected = self.model.fill(ratio, self.now()) if self.target_up else 0
        assert self.device.faults.fill(ratio) == expected

    @rule(enabled=st.booleans())
    def set_key_eviction(self, enabled: bool) -> None:
        self.device.faults.set_key_eviction(enabled)
        self.model.key_eviction = enabled

    @rule(ok=st.booleans())
    def supercap(self, ok: bool) -> None:
        if ok:
            self.device.faults.repair_supercap()
        else:
            self.device.faults.fail_supercap()
        self.model.supercap_ok = ok

    @rule()
    def power_cycle(self) -> None:
        expected = self.model.power_cycle(self.now())
        assert self.device.faults.power_cycle() == expected, "writes lost at a power loss"

    @rule(up=st.booleans())
    def target(self, up: bool) -> None:
        if up:
            self.device.faults.target_up()
        else:
            self.device.faults.target_down()
        self.target_up = up

    @rule(seconds=st.sampled_from([0.0005, 0.002, 1.0]))
    def time_passes(self, seconds: float) -> None:
        self.device.faults.advance(seconds)

    # -- after every step ------------------------------------------------------------

    @invariant()
    def every_key_reads_what_the_model_holds(self) -> None:
        into = memoryview(bytearray(VALUE_BYTES_MAX))
        if not self.target_up:
            with pytest.raises(TargetUnreachable):
                self.device.get(KEY_SPACE[0], into)
            return
        for key in KEY_SPACE:
            got = self.device.get(key, into)
            expected = self.model.values.get(key)
            assert (None if got is None else bytes(into[:got])) == expected, f"key {key[-1]}: wrong answer"
        assert self.device.exists(KEY_SPACE) == [k in self.model.values for k in KEY_SPACE]
        usage = self.device.usage()
        assert (usage.used_bytes, usage.keys) == (self.model.used_bytes, len(self.model.values))


TestSimCard = SimCardMachine.TestCase
TestSimCard.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("eviction", [True, False])
def test_a_full_card_evicts_or_refuses_with_event_3002(eviction: bool) -> None:
    device = SimCardDevice("card", PARAMS, VirtualClock())
    device.faults.set_key_eviction(eviction)
    device.faults.fill(1.0)
    assert device.card_status().capacity_usage is CapacityUsage.CRITICAL
    if eviction:
        device.put(b"k" * 16, [b"v" * VALUE_BYTES_MAX])
        assert device.card.counts["evicted_keys"] >= 1
        assert 3002 not in [e.code for e in device.card_events()]
    else:
        with pytest.raises(DeviceFull, match="81h"):
            device.put(b"k" * 16, [b"v" * VALUE_BYTES_MAX])
        with pytest.raises(DeviceFull):
            device.put(b"j" * 16, [b"v"])
        assert [e.code for e in device.card_events()].count(3002) == 1, "one event per full episode"
        assert device.status_counts() == {"1/81h": 2}


def test_a_refused_write_keeps_the_old_value_and_eviction_takes_the_oldest_first() -> None:
    device = SimCardDevice("card", PARAMS, VirtualClock())
    device.faults.set_key_eviction(False)
    into = memoryview(bytearray(VALUE_BYTES_MAX))
    device.put(KEY_A, [b"old"])
    device.faults.fill(1.0)
    with pytest.raises(DeviceFull):
        device.put(KEY_A, [b"n" * VALUE_BYTES_MAX])
    assert device.get(KEY_A, into) == 3 and bytes(into[:3]) == b"old"
    device.faults.set_key_eviction(True)
    device.put(KEY_B, [b"b" * VALUE_BYTES_MAX])
    assert device.get(KEY_A, into) is None, "written first, evicted first"
    assert device.get(KEY_B, into) == VALUE_BYTES_MAX


# -- planted bugs: the machine must find each ---------------------------------------

_store, _power_cycle = SimCard.store, SimCard.power_cycle


def evict_forgetting_the_index(card: SimCard, nbytes: int) -> None:
    """Frees the oldest values' bytes but leaves their keys readable."""
    values = card._values
    for victim in list(values):
        if card._used_bytes + nbytes <= card.params.capacity_bytes:
            break
        card._used_bytes -= len(values[victim])
        card.counts["evicted_keys"] += 1


def power_cycle_ignoring_the_supercap(card: SimCard) -> int:
    """Flushes the volatile buffer even with a failed supercapacitor."""
    ok, card.supercap_ok = card.supercap_ok, True
    try:
        return _power_cycle(card)
    finally:
        card.supercap_ok = ok


def overwrite_keeping_the_old_value(card: SimCard, key: bytes, value: bytes) -> Stored:
    """Acknowledges an overwrite and keeps serving the old bytes."""
    old = card._values.get(key)
    return _store(card, key, value if old is None else old)


def store_evicting_with_eviction_off(card: SimCard, key: bytes, value: bytes) -> Stored:
    """Never refuses as card full: evicts even when key eviction is off."""
    eviction, card.key_eviction = card.key_eviction, True
    try:
        return _store(card, key, value)
    finally:
        card.key_eviction = eviction


PLANTED: dict[str, tuple[str, Callable[..., object]]] = {
    "eviction forgets the index": ("_evict_for", evict_forgetting_the_index),
    "power cycle keeps unflushed writes with a failed supercap": ("power_cycle", power_cycle_ignoring_the_supercap),
    "stale value after an overwrite": ("store", overwrite_keeping_the_old_value),
    "no card full with eviction off": ("store", store_evicting_with_eviction_off),
}
HUNT = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
"""A fixed, seeded budget without shrinking: a failure found is enough."""


@pytest.mark.parametrize("bug", PLANTED)
def test_the_state_machine_finds_a_planted_bug(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, planted = PLANTED[bug]
    monkeypatch.setattr(SimCard, name, planted)
    # A check of the machine failed: an assert, or a pytest.raises that saw nothing raised.
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        run_state_machine_as_test(SimCardMachine, settings=HUNT)
