"""The RAM refill: after a reboot, copy the persistent tiers' newest objects into RAM.

No RAM tier survives its gateway (the segment is new at every start), so a
gateway that starts over a warm file tier would otherwise answer every hit from
disk until engines have touched it all again. The refill walks each source
tier's manifest from the most recently used object down and copies objects into
the empty RAM tier until it is full or every object is there.

Contracts:

- Nothing wrong is copied: each object is verified (header, key, checksums) as
  it is read; a damaged one is dropped from its tier and counted, never copied.
- Engines always win. A copy holds no lock a request waits on beyond the
  index's own short ones; a refilled object is stored *behind* everything in
  RAM (least recently used, only into free room, never over a key already
  there), so it never evicts what an engine stored meanwhile and is the first
  to go when an engine needs the room. The copy rate is capped
  (``storage.refill_ram_mb_per_s``) so the disk and the CPU stay the engines'.
- It stops between two objects when asked (`stop`), and at the first object
  the RAM tier refuses: a full tier is the end of the refill, not a fault.

Sources are the tiers below the first whose index keeps recency across
processes (a manifest) and whose objects name their engine's fingerprint (no
layout of their own: a card's fingerprints cannot be told before an engine
connects). Tiers are walked top-down, each newest first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from kvharbor.cache.index import Entry
from kvharbor.cache.manifest import ManifestIndex
from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Damaged, Tier
from kvharbor.config import MIB
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.cache.refill")

PAGE_ENTRIES = 256
"""Manifest entries read per query: one short read transaction per page, not one per object."""


class RefillState(Enum):
    OFF = "off"
    """Not configured, or nothing to refill (no RAM first tier, no source, RAM not empty)."""
    RUNNING = "running"
    DONE = "done"
    """Every source object is in RAM, or RAM is full."""
    STOPPED = "stopped"
    """Stopped by the gateway's stop before it was done."""


@dataclass(frozen=True, slots=True)
class RefillStatus:
    """Shown in the gateway's status as ``refill``."""

    state: str
    objects: int
    """Objects copied into RAM."""
    bytes: int
    """Their value bytes."""
    damaged: int
    """Objects that failed verification in their source tier: dropped there, not copied."""
    seconds: float
    done: bool


class RamRefill:
    """One refill of ``store``'s first tier, in a thread of its own (`start`, `stop`)."""

    def __init__(self, store: TieredStore, enabled: bool, rate_mb_per_s: int) -> None:
        assert rate_mb_per_s > 0, rate_mb_per_s
        self._rate_bytes_per_s = rate_mb_per_s * MIB
        self._target, self._sources = _plan(store) if enabled else (None, [])
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._state = RefillState.OFF
        self._objects = self._bytes = self._damaged = 0
        self._started = self._ended = 0.0

    def start(self) -> None:
        """Begin copying in the background, when there is something to copy."""
        if self._target is None or not self._sources:
            return
        self._state = RefillState.RUNNING
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvharbor-refill")
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop between two objects and wait for the thread, at most ``timeout_s``
        (one object's copy); before the store closes under it."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.warning("kvharbor: the RAM refill did not stop within %.1f s; stopping anyway", timeout_s)

    def status(self) -> RefillStatus:
        with self._lock:
            running = self._state is RefillState.RUNNING
            seconds = (time.monotonic() if running else self._ended) - self._started if self._started else 0.0
            return RefillStatus(
                self._state.value,
                self._objects,
                self._bytes,
                self._damaged,
                round(seconds, 3),
                self._state is RefillState.DONE,
            )

    # -- the thread --------------------------------------------------------

    def _run(self) -> None:
        target = self._target
        assert target is not None
        _log.info(
            "kvharbor: refilling RAM tier '%s' (%.3g GiB) from %s in the background, most recently used first, "
            "at most %d MiB/s",
            target.name, target.capacity_bytes / 2**30, ", ".join(f"'{t.name}'" for t in self._sources),
            self._rate_bytes_per_s // MIB,
        )  # fmt: skip
        state = RefillState.DONE
        for source, entry in self._candidates():
            if self._stopping.is_set() or not self._paced():
                state = RefillState.STOPPED
                break
            if not self._copy(source, target, entry):
                break
        with self._lock:
            self._state = state
            self._ended = time.monotonic()
        status = self.status()
        _log.info(
            "kvharbor: RAM tier '%s' refill %s: %d objects, %d bytes in %.2f s (%d damaged, dropped)",
            target.name, "done" if status.done else "stopped at gateway stop", status.objects, status.bytes,
            status.seconds, status.damaged,
        )  # fmt: skip

    def _candidates(self) -> Iterator[tuple[Tier, Entry]]:
        """Every source object, source by source, each newest first."""
        for source in self._sources:
            cursor: int | None = None
            while True:
                index = source.index  # Re-read: a damaged manifest is replaced by a rebuilt one.
                if not isinstance(index, ManifestIndex):
                    break
                entries, cursor = index.most_recent(PAGE_ENTRIES, cursor)
                yield from ((source, entry) for entry in entries)
                if cursor is None or len(entries) < PAGE_ENTRIES:
                    break

    def _copy(self, source: Tier, target: Tier, entry: Entry) -> bool:
        """Copy one object; False when the target is full (the refill's end)."""
        if target.contains([entry.key])[0]:
            return True  # An engine stored or restored it meanwhile.
        read = source.read_described(entry.key)
        if isinstance(read, Damaged):
            with self._lock:
                self._damaged += 1
            return True
        if read is None:
            return True  # Gone meanwhile, or unreadable (said by the tier): not ours to judge.
        fingerprint, value = read
        if not target.write(entry.key, fingerprint, value, behind=True):
            # Full, or taken by an engine between the check and the write: only the first ends it.
            return target.contains([entry.key])[0]
        with self._lock:
            self._objects += 1
            self._bytes += value.nbytes
        return True

    def _paced(self) -> bool:
        """Wait until the bytes copied so far are within the rate cap; False when stopped meanwhile."""
        ahead_s = self._bytes / self._rate_bytes_per_s - (time.monotonic() - self._started)
        return ahead_s <= 0 or not self._stopping.wait(ahead_s)


def _plan(store: TieredStore) -> tuple[Tier | None, list[Tier]]:
    """The RAM tier to refill and its sources, or (None, []) when there is none to refill."""
    if not store.tiers or store.tiers[0].device_type != "ram":
        return None, []
    target = store.tiers[0]
    if target.index.count() != 0:
        return None, []
    sources = [t for t in store.tiers[1:] if isinstance(t.index, ManifestIndex) and not t.layout]
    return target, sources
