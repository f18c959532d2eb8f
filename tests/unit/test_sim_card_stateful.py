"""The simulated card under any sequence of operations and faults never serves wrong bytes.

A hypothesis state machine drives a real `SimCardDevice` on virtual time: puts,
gets, deletes, fills, key eviction switched on and off, power cycles with a
healthy or failed supercapacitor, the remote target down and up, time passing.
The model keeps, per key, the last value the card acknowledged and what has
happened since; the card may forget a value only for a reason the model saw
(evicted, lost at a power loss, deleted), and never answers other bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvharbor.hal.base import CapacityUsage, DeviceFull, TargetUnreachable
from kvharbor.hal.sim.clock import VirtualClock
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.events import CardEventCode
from kvharbor.hal.sim.params import CardParams

VALUE_BYTES_MAX = 4096
PARAMS = CardParams(
    capacity_bytes=4 * VALUE_BYTES_MAX, keys_max=6, value_bytes_max=VALUE_BYTES_MAX, persist_delay_s=0.001
)
KEYS = st.integers(0, 5).map(lambda n: n.to_bytes(16, "big"))
KEY_A, KEY_B = b"a" * 16, b"b" * 16


@dataclass(frozen=True)
class Written:
    value: bytes
    evicted_before: int
    """The card's evicted-key count when this value was acknowledged."""
    lost_before: int


class SimCardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.device = SimCardDevice("card", PARAMS, VirtualClock())
        self.card = self.device.card
        self.written: dict[bytes, Written] = {}
        self.target_up = True
        """False only inside `target_outage`."""
        self.serial = 0

    @initialize(enabled=st.booleans())
    def start_with_key_eviction(self, enabled: bool) -> None:
        self.device.faults.set_key_eviction(enabled)

    # -- operations --------------------------------------------------------------

    @rule(key=KEYS, size=st.integers(0, VALUE_BYTES_MAX))
    def put(self, key: bytes, size: int) -> None:
        self.serial += 1
        value = self.serial.to_bytes(4, "big") * (size // 4) + b"\x5a" * (size % 4)
        events_before = self.card.events.counts[CardEventCode.CARD_FULL]
        try:
            self.device.put(key, [value[: size // 2], value[size // 2 :]])
        except TargetUnreachable:
            assert not self.target_up
            return
        except DeviceFull:
            assert self.target_up
            assert not self.card.key_eviction, "with key eviction on the card keeps accepting writes"
            assert self.card.capacity_usage is CapacityUsage.CRITICAL
            full_events = self.card.events.counts[CardEventCode.CARD_FULL]
            assert full_events >= 1 and full_events - events_before <= 1, "one 3002 per full episode"
            assert any(e.code == 3002 for e in self.device.card_events())
            return  # The old value, if any, stays readable (checked by `get`).
        assert self.target_up
        self.written[key] = Written(value, self.card.counts["evicted_keys"], self.card.counts["lost_writes"])

    @rule(key=KEYS)
    def get(self, key: bytes) -> None:
        buffer = memoryview(bytearray(VALUE_BYTES_MAX))
        try:
            got = self.device.get(key, buffer)
        except TargetUnreachable:
            assert not self.target_up
            return
        assert self.target_up
        known = self.written.get(key)
        if got is None:
            if known is not None:
                forgotten = (
                    self.card.counts["evicted_keys"] > known.evicted_before
                    or self.card.counts["lost_writes"] > known.lost_before
                )
                assert forgotten, "an acknowledged value vanished with no eviction or power loss since"
                del self.written[key]
            return
        assert known is not None, "bytes served for a key never written (or deleted)"
        assert bytes(buffer[:got]) == known.value, "wrong bytes served"

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        try:
            self.device.delete(key)
        except TargetUnreachable:
            assert not self.target_up
            return
        self.written.pop(key, None)

    # -- faults and operator actions -----------------------------------------------

    @rule(ratio=st.sampled_from([0.5, 0.9, 1.0]))
    def fill(self, ratio: float) -> None:
        if self.target_up:
            self.device.faults.fill(ratio)

    @rule(enabled=st.booleans())
    def set_key_eviction(self, enabled: bool) -> None:
        self.device.faults.set_key_eviction(enabled)

    @rule()
    def fail_supercap(self) -> None:
        self.device.faults.fail_supercap()

    @rule()
    def repair_supercap(self) -> None:
        self.device.faults.repair_supercap()

    @rule()
    def power_cycle(self) -> None:
        lost = self.device.faults.power_cycle()
        if self.card.supercap_ok:
            assert lost == 0, "a healthy supercapacitor flushes every write"

    @rule(key=KEYS)
    def target_outage(self, key: bytes) -> None:
        """The remote target goes away: every operation says so, nothing is changed; then it is back."""
        self.device.faults.target_down()
        self.target_up = False
        self.put(key, 8)
        self.get(key)
        self.delete(key)
        with pytest.raises(TargetUnreachable):
            self.device.exists([key])
        self.device.faults.target_up()
        self.target_up = True

    @rule(seconds=st.sampled_from([0.0005, 0.002, 1.0]))
    def time_passes(self, seconds: float) -> None:
        self.device.faults.advance(seconds)

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def usage_is_within_the_card(self) -> None:
        usage = self.device.usage()
        assert 0 <= usage.used_bytes <= PARAMS.capacity_bytes
        assert 0 <= usage.keys <= PARAMS.keys_max


TestSimCard = SimCardMachine.TestCase
TestSimCard.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


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
