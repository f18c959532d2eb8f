"""The simulated card's state and its answers, as NVMe KV status codes.

`SimCard` is what the card itself knows: the values it holds (in write order,
the order key eviction takes them in), capacity and key limits, its usage
level, temperature, flash, supercapacitor, power and the path to its remote
target. Each operation answers a `KvStatus` and the card time at which it
completes (see `channels`); it does not wait, so that its caller can wait
outside its lock. Not thread-safe: `SimCardDevice` serialises calls.

Durability: a stored value sits in the card's volatile buffer for
``persist_delay_s`` before it is on flash. A power loss with a healthy
supercapacitor flushes the buffer; with a failed one, the values still in it are
lost: their keys become misses, never old or partial bytes served as valid.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Generator
from typing import NamedTuple

import simpy

from kvharbor.hal.base import CapacityUsage, CardStatus, Health, HealthState
from kvharbor.hal.kv_status import (
    CAPACITY_EXCEEDED,
    HOST_PATHING_ERROR,
    INVALID_KEY_SIZE,
    INVALID_VALUE_SIZE,
    KEY_NOT_FOUND,
    SUCCESS,
    KvStatus,
)
from kvharbor.hal.sim.channels import Channels
from kvharbor.hal.sim.clock import CardClock
from kvharbor.hal.sim.events import CardEventCode, CardEventLog
from kvharbor.hal.sim.params import CardParams

FILL_KEY_PREFIX = b"\xfe\xedfill"
"""Keys `SimCard.fill` writes: 16 bytes, never a chunk key (those are hashes) by chance."""


# Answers are named tuples, not frozen dataclasses: made once per operation, and a
# frozen dataclass costs several times more to make (it sets fields through object.__setattr__).


class Stored(NamedTuple):
    """What ``store`` and ``delete`` answered, and when the operation completes (card time)."""

    status: KvStatus
    done_s: float


class Retrieved(NamedTuple):
    status: KvStatus
    value: bytes | None
    done_s: float


class SimCard:
    def __init__(self, params: CardParams, clock: CardClock) -> None:
        self.params = params
        self.clock = clock
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._used_bytes = 0
        self._channels = Channels(params.channels, params.stripe_bytes)
        self._read_rate = params.channel_read_bytes_per_s
        self._write_rate = params.channel_write_bytes_per_s
        self._unflushed: deque[tuple[float, bytes, bytes]] = deque()
        """(on flash at, key, value) of recent writes, oldest first."""
        self.key_eviction = params.key_eviction
        self.temperature_c = params.temperature_c
        self.supercap_ok = params.supercap_ok
        self.target_up = True
        self.events = CardEventLog(params.events_max)
        self.counts: Counter[str] = Counter()
        """evicted keys, refused writes (card full), lost writes, power cycles."""
        self._bytes_written = 0
        self._level = CapacityUsage.OK
        # The usage thresholds in bytes and keys, so that each write compares instead of dividing.
        self._warning_at = (
            int(params.warning_usage_ratio * params.capacity_bytes),
            int(params.warning_usage_ratio * params.keys_max),
        )
        self._critical_at = (
            int(params.critical_usage_ratio * params.capacity_bytes),
            int(params.critical_usage_ratio * params.keys_max),
        )
        self._full_said = False
        self._slow = 1.0
        for window in params.target_windows:
            self.schedule_target_window(window.start_s, window.duration_s)

    # -- operations ----------------------------------------------------------

    def store(self, key: bytes, value: bytes) -> Stored:
        now = self._begin()
        params = self.params
        if not self.target_up:
            return Stored(HOST_PATHING_ERROR, now)
        if not 0 < len(key) <= params.key_bytes_max:
            return Stored(INVALID_KEY_SIZE, now)
        nbytes = len(value)
        if nbytes > params.value_bytes_max:
            return Stored(INVALID_VALUE_SIZE, now)
        values = self._values
        old = values.get(key)
        old_bytes = 0 if old is None else len(old)
        fits = (
            self._used_bytes - old_bytes + nbytes <= params.capacity_bytes
            and len(values) + (old is None) <= params.keys_max
        )
        if not fits and not self.key_eviction:
            self._refuse_full(now)  # Nothing changed: the old value stays, in its place in write order.
            return Stored(CAPACITY_EXCEEDED, now)
        if old is not None:  # Replaced: the new value is the newest written.
            del values[key]
            self._used_bytes -= old_bytes
        if not fits:
            self._evict_for(nbytes)
        values[key] = value
        self._used_bytes += nbytes
        self._bytes_written += nbytes
        unflushed = self._unflushed
        while unflushed and unflushed[0][0] <= now:
            unflushed.popleft()
        unflushed.append((now + params.persist_delay_s, key, value))
        self._full_said = False
        self._note_usage(now)
        return Stored(
            SUCCESS, self._channels.complete_at(now, nbytes, self._write_rate, params.write_latency_s * self._slow)
        )

    def retrieve(self, key: bytes) -> Retrieved:
        now = self._begin()
        if not self.target_up:
            return Retrieved(HOST_PATHING_ERROR, None, now)
        value = self._values.get(key)
        latency_s = self.params.read_latency_s * self._slow
        if value is None:
            return Retrieved(KEY_NOT_FOUND, None, now + latency_s)
        return Retrieved(SUCCESS, value, self._channels.complete_at(now, len(value), self._read_rate, latency_s))

    def exist(self, keys: list[bytes]) -> tuple[KvStatus, list[bool], float]:
        now = self._begin()
        if not self.target_up:
            return HOST_PATHING_ERROR, [], now
        values = self._values
        return SUCCESS, [k in values for k in keys], now + self.params.read_latency_s * self._slow

    def delete(self, key: bytes) -> Stored:
        now = self._begin()
        if not self.target_up:
            return Stored(HOST_PATHING_ERROR, now)
        value = self._values.pop(key, None)
        done_s = now + self.params.delete_latency_s * self._slow
        if value is None:
            return Stored(KEY_NOT_FOUND, done_s)
        self._used_bytes -= len(value)
        self._note_usage(now)
        return Stored(SUCCESS, done_s)

    def list_keys(self) -> tuple[KvStatus, list[tuple[bytes, int]]]:
        self._begin()
        if not self.target_up:
            return HOST_PATHING_ERROR, []
        return SUCCESS, [(k, len(v)) for k, v in self._values.items()]

    # -- state -----------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def keys(self) -> int:
        return len(self._values)

    @property
    def capacity_usage(self) -> CapacityUsage:
        return self._level

    @property
    def flash_wear_percent(self) -> float:
        worn = 100.0 * self._bytes_written / self.params.flash_endurance_bytes
        return min(100.0, self.params.flash_wear_percent + worn)

    def status(self, driver: str) -> CardStatus:
        self._begin()
        return CardStatus(
            driver=driver,
            service="running" if self.target_up else "target unreachable",
            firmware_version=self.params.firmware_version,
            temperature_c=self.temperature_c,
            supercap="ok" if self.supercap_ok else "failed",
            flash_spare_percent=self.params.flash_spare_percent,
            flash_wear_percent=self.flash_wear_percent,
            capacity_usage=self._level,
            used_bytes=self._used_bytes,
            capacity_bytes=self.params.capacity_bytes,
            keys=len(self._values),
            keys_max=self.params.keys_max,
            key_eviction=self.key_eviction,
        )

    def health(self) -> Health:
        self._begin()
        params = self.params
        if not self.target_up:
            return Health(HealthState.FAILED, "remote target unreachable")
        if self.temperature_c >= params.temperature_critical_c:
            return Health(HealthState.FAILED, f"temperature {self.temperature_c:g} C is critical")
        problems = []
        if not self.supercap_ok:
            problems.append("supercapacitor failed: writes not yet on flash are lost at a power loss")
        if self.temperature_c >= params.temperature_warning_c:
            problems.append(f"temperature {self.temperature_c:g} C: throttled")
        if self._level is CapacityUsage.CRITICAL and not self.key_eviction:
            problems.append("CapacityUsage CRITICAL with key eviction off: new values are refused")
        if problems:
            return Health(HealthState.DEGRADED, "; ".join(problems))
        return Health(HealthState.OK)

    # -- faults and operator actions -------------------------------------------

    def set_key_eviction(self, enabled: bool) -> None:
        if enabled != self.key_eviction:
            self.key_eviction = enabled
            code = CardEventCode.KEY_EVICTION_ON if enabled else CardEventCode.KEY_EVICTION_OFF
            self.events.add(self._begin(), code, f"key eviction {'enabled' if enabled else 'disabled'}")

    def fill(self, ratio: float = 1.0) -> int:
        """Store filler values until usage reaches ``ratio`` of capacity, or the card refuses;
        returns how many were stored. With key eviction on, older values make room."""
        if not 0 < ratio <= 1:
            raise ValueError(f"fill: ratio must be in (0, 1] (got {ratio})")
        params = self.params
        target = int(ratio * params.capacity_bytes)
        filler = bytes(params.value_bytes_max)
        stored = 0
        while self._used_bytes < target:
            before = self._used_bytes
            size = min(len(filler), target - before)
            key = FILL_KEY_PREFIX + (self.counts["filled"] + stored).to_bytes(16 - len(FILL_KEY_PREFIX), "big")
            if self.store(key, filler[:size]).status != SUCCESS:
                break
            stored += 1
            if self._used_bytes <= before:
                break  # Full of keys: each filler evicts as many bytes as it brings.
        self.counts["filled"] += stored
        return stored

    def wipe(self) -> int:
        removed = len(self._values)
        self._values.clear()
        self._unflushed.clear()
        self._used_bytes = 0
        now = self._begin()
        self.events.add(now, CardEventCode.CARD_WIPED, f"card wiped: {removed} keys removed")
        self._note_usage(now)
        return removed

    def set_supercap(self, ok: bool) -> None:
        if ok != self.supercap_ok:
            self.supercap_ok = ok
            code = CardEventCode.SUPERCAP_OK if ok else CardEventCode.SUPERCAP_FAILED
            self.events.add(self._begin(), code, "supercapacitor " + ("healthy" if ok else "failed"))

    def power_cycle(self) -> int:
        """Lose power and come back; returns how many writes were lost (none with a healthy supercapacitor)."""
        now = self._begin()
        self.events.add(now, CardEventCode.POWER_LOSS, "power lost")
        self.counts["power_cycles"] += 1
        lost = 0
        if not self.supercap_ok:
            values = self._values
            for flushed_s, key, value in self._unflushed:
                # Only the value still under its key is lost; a later write replaced it otherwise.
                if flushed_s > now and values.get(key) is value:
                    del values[key]
                    self._used_bytes -= len(value)
                    lost += 1
            if lost:
                self.events.add(now, CardEventCode.WRITES_LOST, f"{lost} writes not yet on flash were lost")
            self.counts["lost_writes"] += lost
        self._unflushed.clear()
        self._channels.reset()
        self._note_usage(now)
        return lost

    def set_target(self, up: bool) -> None:
        if up != self.target_up:
            self.target_up = up
            code = CardEventCode.TARGET_UP if up else CardEventCode.TARGET_DOWN
            self.events.add(self.clock.now(), code, "remote target " + ("answers again" if up else "stopped answering"))

    def schedule_target_window(self, start_s: float, duration_s: float) -> None:
        """The target stops answering at card time ``start_s`` for ``duration_s``."""
        if start_s < 0 or duration_s <= 0:
            raise ValueError(f"target window: needs start_s >= 0 and duration_s > 0 (got {start_s}, {duration_s})")
        self.clock.start(self._target_window(start_s, duration_s))

    def set_temperature(self, celsius: float) -> None:
        params = self.params
        before, self.temperature_c = self.temperature_c, celsius
        self._slow = params.throttle_factor if celsius >= params.temperature_warning_c else 1.0
        band = _band(celsius, params.temperature_warning_c, params.temperature_critical_c)
        if band != _band(before, params.temperature_warning_c, params.temperature_critical_c):
            code = (CardEventCode.TEMPERATURE_OK, CardEventCode.TEMPERATURE_WARNING, CardEventCode.TEMPERATURE_CRITICAL)
            self.events.add(self._begin(), code[band], f"temperature {celsius:g} C")

    # -- internals -------------------------------------------------------------

    def _begin(self) -> float:
        """Bring scheduled changes up to now; returns now."""
        return self.clock.tick()

    def _target_window(self, start_s: float, duration_s: float) -> Generator[simpy.Event, None, None]:
        env = self.clock.env
        yield env.timeout(max(0.0, start_s - env.now))
        self.set_target(False)
        yield env.timeout(max(0.0, start_s + duration_s - env.now))
        self.set_target(True)

    def _evict_for(self, nbytes: int) -> None:
        """Drop the oldest written values until ``nbytes`` and one more key fit."""
        values, params = self._values, self.params
        evicted = 0
        while values and (self._used_bytes + nbytes > params.capacity_bytes or len(values) >= params.keys_max):
            _, victim = values.popitem(last=False)
            self._used_bytes -= len(victim)
            evicted += 1
        self.counts["evicted_keys"] += evicted

    def _refuse_full(self, now: float) -> None:
        self.counts["full_refusals"] += 1
        if not self._full_said:
            self._full_said = True
            self.events.add(
                now,
                CardEventCode.CARD_FULL,
                f"card full ({self._used_bytes} bytes, {len(self._values)} keys); key eviction off: write refused",
            )
        self._note_usage(now)

    def _note_usage(self, now: float) -> None:
        used, keys = self._used_bytes, len(self._values)
        critical, warning = self._critical_at, self._warning_at
        if used >= critical[0] or keys >= critical[1] or (self._full_said and not self.key_eviction):
            level = CapacityUsage.CRITICAL
        elif used >= warning[0] or keys >= warning[1]:
            level = CapacityUsage.WARNING
        else:
            level = CapacityUsage.OK
        if level is not self._level:
            self._level = level
            params = self.params
            ratio = max(used / params.capacity_bytes, keys / params.keys_max)
            self.events.add(now, _LEVEL_EVENTS[level], f"CapacityUsage {level.value} ({ratio:.0%})")


_LEVEL_EVENTS = {
    CapacityUsage.OK: CardEventCode.CAPACITY_OK,
    CapacityUsage.WARNING: CardEventCode.CAPACITY_WARNING,
    CapacityUsage.CRITICAL: CardEventCode.CAPACITY_CRITICAL,
}


def _band(celsius: float, warning_c: float, critical_c: float) -> int:
    return 2 if celsius >= critical_c else 1 if celsius >= warning_c else 0
