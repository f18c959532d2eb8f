"""The HAL driver of the simulated card: the device protocol hardware uses, plus faults.

`SimCardDevice` turns the card's NVMe KV status codes into the protocol's
answers as every card driver does (`kvharbor.hal.kv_judge`): a key that is not
there is a miss (counted by code, never logged), a full card raises
`DeviceFull`, a lost path `TargetUnreachable`; every other status is logged
once per code with its meaning, counted by code, and raised typed.

Calls are serialised on one lock (the card is one state machine), but the
caller waits for an operation's completion outside it, so that in scaled real
time operations of several gateway threads overlap on the card's channels.

`CardFaults` (``device.faults``) is what scenarios and tests call: fill, key
eviction, supercapacitor, power, remote target, temperature.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvharbor.hal.base import (
    STREAM_SLICE_BYTES,
    Buffer,
    BufferTooSmall,
    CardDevice,
    CardEventRecord,
    CardStatus,
    Device,
    DeviceEvent,
    DeviceEventKind,
    EventSource,
    Health,
    SliceConsumer,
    Usage,
    copy_streamed,
)
from kvharbor.hal.kv_judge import StatusJudge
from kvharbor.hal.kv_status import SUCCESS
from kvharbor.hal.sim.card import SimCard
from kvharbor.hal.sim.clock import CardClock, ScaledClock, VirtualClock
from kvharbor.hal.sim.control import ControlFile, ControlState
from kvharbor.hal.sim.events import CardEventCode
from kvharbor.hal.sim.params import CardParams

DRIVER_NAME = "kvharbor-sim"

# fmt: off
_EVENT_KINDS: dict[CardEventCode, DeviceEventKind] = {
    CardEventCode.CARD_FULL:       DeviceEventKind.FULL,
    CardEventCode.TARGET_UP:       DeviceEventKind.RESTARTED,
    CardEventCode.SUPERCAP_FAILED: DeviceEventKind.POWER_FAULT,
    CardEventCode.WRITES_LOST:     DeviceEventKind.POWER_FAULT,
}
# fmt: on


class SimCardDevice(Device, CardDevice, EventSource):
    def __init__(
        self, name: str, params: CardParams, clock: CardClock | None = None, max_value_bytes: int | None = None
    ) -> None:
        """A card with ``params`` on ``clock`` (default: scaled real time at ``params.time_scale``);
        values up to ``max_value_bytes`` (default and most: the card's ``value_bytes_max``)."""
        super().__init__(name, min(params.value_bytes_max, max_value_bytes or params.value_bytes_max))
        self.card = SimCard(params, clock if clock is not None else ScaledClock(params.time_scale))
        self.faults = CardFaults(self)
        self._clock = self.card.clock
        self._lock = threading.Lock()
        self._judge = StatusJudge(name)
        self._drained_seq = 0
        self._control = ControlFile(params.control_path, params.control_poll_s) if params.control_path else None

    # -- the device protocol -----------------------------------------------------

    # The protocol's calls check success inline and call `_judge` only for other answers:
    # a call per operation is a fair share of the simulator's cost (see bench/card.py).

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)
        if len(value) > self.max_value_bytes:
            self.check_value_size(parts)  # Raises, with the protocol's message.
        with self._lock:
            reply = self._live().store(bytes(key), value)
        self._clock.wait(reply.done_s)
        if reply.status is not SUCCESS:
            self._judge.judge(reply.status, "store")

    def get(self, key: bytes, into: memoryview) -> int | None:
        value = self._retrieve(key, into)
        if value is None:
            return None
        into[: len(value)] = value
        return len(value)

    def get_streamed(
        self, key: bytes, into: memoryview, consume: SliceConsumer, slice_bytes: int = STREAM_SLICE_BYTES
    ) -> int | None:
        value = self._retrieve(key, into)
        if value is None:
            return None
        return copy_streamed(memoryview(value), into, consume, slice_bytes)

    def size(self, key: bytes) -> int | None:
        # A Retrieve with no host buffer answers the value's size, as the KV command set's does.
        with self._lock:
            reply = self._live().retrieve(key)
        self._clock.wait(reply.done_s)
        if reply.status is not SUCCESS and not self._judge.judge(reply.status, "retrieve"):
            return None
        assert reply.value is not None
        return len(reply.value)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            status, flags, done_s = self._live().exist(list(keys))
        self._clock.wait(done_s)
        if status is not SUCCESS:
            self._judge.judge(status, "exist")
        return flags

    def delete(self, key: bytes) -> bool:
        with self._lock:
            reply = self._live().delete(key)
        self._clock.wait(reply.done_s)
        return reply.status is SUCCESS or self._judge.judge(reply.status, "delete")

    def scan(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            status, items = self._live().list_keys()
        self._judge.judge(status, "list")
        yield from items

    def usage(self) -> Usage:
        with self._lock:
            return Usage(self.card.used_bytes, self.card.params.capacity_bytes, self.card.keys)

    def health(self) -> Health:
        with self._lock:
            return self.card.health()

    # -- card abilities ----------------------------------------------------------

    def card_status(self) -> CardStatus:
        with self._lock:
            return self.card.status(DRIVER_NAME)

    def card_events(self, since_seq: int = 0) -> list[CardEventRecord]:
        with self._lock:
            events = self.card.events.since(since_seq)
        return [CardEventRecord(e.seq, e.time_s, int(e.code), e.code.name.lower(), e.message) for e in events]

    def set_key_eviction(self, enabled: bool) -> None:
        with self._lock:
            self.card.set_key_eviction(enabled)

    def status_counts(self) -> dict[str, int]:
        return self._judge.counts()

    def wipe(self) -> int:
        with self._lock:
            return self._live().wipe()

    def drain_events(self) -> list[DeviceEvent]:
        with self._lock:
            events = self.card.events.since(self._drained_seq)
            self._drained_seq = self.card.events.last_seq
        return [DeviceEvent(_EVENT_KINDS[e.code], self.name, e.message) for e in events if e.code in _EVENT_KINDS]

    # -- internals ---------------------------------------------------------------

    def _live(self) -> SimCard:
        """The card, with faults from its control file applied (call under the lock)."""
        if self._control is not None:
            changed = self._control.changes()
            if changed is not None:
                _apply(self.card, *changed)
        return self.card

    def _retrieve(self, key: bytes, into: memoryview) -> bytes | None:
        with self._lock:
            reply = self._live().retrieve(key)
        self._clock.wait(reply.done_s)
        if reply.status is not SUCCESS and not self._judge.judge(reply.status, "retrieve"):
            return None
        value = reply.value
        assert value is not None
        if into.nbytes < len(value):
            raise BufferTooSmall(self.name, len(value), into.nbytes)
        return value


class CardFaults:
    """The fault-injection API of a simulated card (scenarios, tests, the planner)."""

    def __init__(self, device: SimCardDevice) -> None:
        self._device = device

    def fill(self, ratio: float = 1.0) -> int:
        """Fill to ``ratio`` of capacity with filler values; returns how many were stored."""
        with self._device._lock:
            return self._device.card.fill(ratio)

    def set_key_eviction(self, enabled: bool) -> None:
        self._device.set_key_eviction(enabled)

    def fail_supercap(self) -> None:
        with self._device._lock:
            self._device.card.set_supercap(False)

    def repair_supercap(self) -> None:
        with self._device._lock:
            self._device.card.set_supercap(True)

    def power_cycle(self) -> int:
        """Lose power and come back; returns how many writes were lost."""
        with self._device._lock:
            return self._device.card.power_cycle()

    def target_down(self) -> None:
        with self._device._lock:
            self._device.card.set_target(False)

    def target_up(self) -> None:
        with self._device._lock:
            self._device.card.set_target(True)

    def schedule_target_window(self, start_s: float, duration_s: float) -> None:
        """The target stops answering at card time ``start_s`` for ``duration_s``."""
        with self._device._lock:
            self._device.card.schedule_target_window(start_s, duration_s)

    def set_temperature(self, celsius: float) -> None:
        with self._device._lock:
            self._device.card.set_temperature(celsius)

    def advance(self, seconds: float) -> None:
        """Let virtual card time pass (virtual clock only: real time passes by itself)."""
        clock = self._device._clock
        if not isinstance(clock, VirtualClock):
            raise TypeError("advance: only a card on virtual time can be moved forward by hand")
        with self._device._lock:
            clock.advance(seconds)


def _apply(card: SimCard, before: ControlState, now: ControlState) -> None:
    """Apply each control field that changed (see `kvharbor.hal.sim.control`)."""
    if now.target_up is not None and now.target_up != before.target_up:
        card.set_target(now.target_up)
    if now.key_eviction is not None and now.key_eviction != before.key_eviction:
        card.set_key_eviction(now.key_eviction)
    if now.supercap_ok is not None and now.supercap_ok != before.supercap_ok:
        card.set_supercap(now.supercap_ok)
    if now.temperature_c is not None and now.temperature_c != before.temperature_c:
        card.set_temperature(now.temperature_c)
    if now.power_cycles is not None and now.power_cycles > (before.power_cycles or 0):
        card.power_cycle()
    if now.fill_ratio is not None and now.fill_ratio != before.fill_ratio:
        card.fill(now.fill_ratio)
