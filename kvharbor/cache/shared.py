"""One cache for many hosts: the index and the budget of a tier that hosts share (S3).

A host's SQLite manifest is safe only among the processes of one host, so a
shared tier is indexed differently:

- **What is there** is the object store's answer, not a local table. Each host
  keeps a `MemoryIndex` of what it knows (what it stored, what it found; at most
  the tier's budget of it, least recently used forgotten first); a key
  it does not know is asked of the store (a HEAD per key, in parallel), so host
  B finds what host A stored as soon as A's PUT returned (S3 is strongly
  consistent for reads after writes). A key found absent is not asked again for
  ``miss_ttl_ms``: the engine repeats its lookup each step.
- **The budget** holds for the tier as a whole. One host at a time is the
  evictor, by a lease: a record under the prefix written with conditional puts
  (``If-None-Match: *`` to take a free one, ``If-Match: <etag>`` to renew one's
  own or take over one its holder let lapse for ``lease_s`` by the server's
  clock), so two hosts can never both win the same version. Every
  ``budget_interval_s`` the holder lists the prefix and deletes the values
  written longest ago until the total is within ``capacity_gb``, aborts uploads
  abandoned for ``abandoned_upload_s``, and writes the totals into the lease
  record, where every other host reads them (the tier's used bytes and keys).

Consistency this gives (documented in docs/tiers.md):

- the shared tier exceeds its budget by at most what all hosts write in one
  interval (plus one interval while a lapsed lease is taken over); admissions
  never wait for another host;
- eviction is oldest-written first: reads on other hosts do not refresh an
  object (S3 keeps no access time);
- a value evicted or replaced while another host reads it is a miss there,
  never a wrong value: every read is verified, and a PUT is atomic;
- two evictors can only coexist when a holder stalls past its lease; then both
  delete the oldest values: more is evicted than needed, nothing wrong is read.
  A holder does not delete once more than half its lease has passed since it
  renewed it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from kvharbor.cache.index import Entry, MemoryIndex, OverBudget, TierIndex, check_admission
from kvharbor.config import S3TierSection
from kvharbor.hal.base import Device, DeviceError, PreconditionFailed, Record, SharedDevice, StoredObject
from kvharbor.periodic import Periodic
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.cache.shared")

LEASE_RECORD = "evictor-lease"
ABSENT_ENTRIES_MAX = 100_000
"""Keys remembered as absent at most; past it the expired ones are forgotten."""


@dataclass(frozen=True, slots=True)
class SharedSettings:
    capacity_bytes: int
    miss_ttl_s: float
    budget_interval_s: float
    lease_s: float
    abandoned_upload_s: float

    @classmethod
    def of(cls, section: S3TierSection) -> SharedSettings:
        return cls(
            section.capacity_bytes,
            section.miss_ttl_ms / 1000,
            section.budget_interval_s,
            section.lease_s,
            section.abandoned_upload_s,
        )


@dataclass(frozen=True, slots=True)
class LeaseBody:
    """The lease record: who evicts, and the totals its last sweep found."""

    holder: str
    used_bytes: int = -1
    """-1: not swept yet."""
    objects: int = -1
    evicted: int = 0
    """Values the holder's sweeps deleted, all of them together."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, body: bytes) -> LeaseBody | None:
        """None for a record that is not a lease of this format (then it is taken over as lapsed)."""
        try:
            fields = json.loads(body)
            return cls(str(fields["holder"]), int(fields["used_bytes"]), int(fields["objects"]), int(fields["evicted"]))
        except (ValueError, KeyError, TypeError):
            return None


def host_id() -> str:
    """This process among every host sharing a tier: host name, pid and a random tag
    (network namespaces on one machine share a host name; a restarted gateway is new)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


class SharedIndex(TierIndex):
    """The index of a shared tier; see the module docstring. `admit` never returns victims:
    the lease holder's sweep keeps the budget. This host's sweeps run every
    ``budget_interval_s`` from one interval after it opens; `close` stops them."""

    def __init__(self, device: Device, tier_name: str, settings: SharedSettings, holder: str | None = None) -> None:
        if not isinstance(device, SharedDevice):
            raise TypeError(f"tier '{tier_name}': {type(device).__name__} is not a shared device")
        self._device = device
        self.tier_name = tier_name
        self.settings = settings
        self.holder = holder or host_id()
        self._local = MemoryIndex()
        self._absent: dict[bytes, float] = {}
        """Key -> until when (monotonic s) it is taken as absent without asking."""
        self._absent_lock = threading.Lock()
        self._shared: LeaseBody | None = None
        """The totals of the last sweep, read from the lease record."""
        self._once = OnceLog(_log)
        self._count_eviction: Callable[[int], None] = _uncounted
        self._sweeper = Periodic(f"kvharbor-budget-{tier_name}", settings.budget_interval_s, self._sweep_round).start()

    def count_evictions(self, evicted: Callable[[int], None]) -> None:
        """Have each value this host's sweeps evict counted by ``evicted(nbytes)`` (its
        tier's metrics: the sum over hosts is what the shared tier evicted)."""
        self._count_eviction = evicted

    # -- TierIndex -----------------------------------------------------------

    def admit(
        self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes] = frozenset(), behind: bool = False
    ) -> list[Entry]:
        check_admission(entry, budget_bytes)
        if behind:
            shared = self._shared
            used = shared.used_bytes if shared is not None and shared.used_bytes >= 0 else self._local.used_bytes()
            if used + entry.nbytes > budget_bytes:
                raise OverBudget(f"{entry.nbytes} bytes do not fit the free room of the shared budget {budget_bytes}")
        self._remember(entry)
        with self._absent_lock:
            self._absent.pop(entry.key, None)
        return []

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Known keys from memory; the others asked of the store (those not found absent
        within ``miss_ttl_ms``), and what is found remembered."""
        present = self._local.contains(keys)
        now_s = time.monotonic()
        with self._absent_lock:
            unknown = [
                key for key, here in zip(keys, present, strict=True) if not here and self._absent.get(key, 0) <= now_s
            ]
        if not unknown:
            return present
        sizes = self._device.sizes(unknown)
        found: set[bytes] = set()
        for key, size in zip(unknown, sizes, strict=True):
            if size is not None:
                # Values of a file or S3 tier are never fragmented (they are at most
                # storage.value_mb_max): one object each. Its layout is learned if it is read.
                self._remember(Entry(bytes(key), size, 1))
                found.add(key)
        self._remember_absent([key for key in unknown if key not in found], now_s)
        return [here or key in found for key, here in zip(keys, present, strict=True)]

    def get(self, key: bytes) -> Entry | None:
        return self._local.get(key)

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        return self._local.nbytes(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._local.touch(keys)

    def remove(self, keys: Sequence[bytes]) -> None:
        self._local.remove(keys)

    def used_bytes(self) -> int:
        shared = self._shared
        return shared.used_bytes if shared is not None and shared.used_bytes >= 0 else self._local.used_bytes()

    def count(self) -> int:
        shared = self._shared
        return shared.objects if shared is not None and shared.objects >= 0 else self._local.count()

    def lru(self, limit: int) -> list[Entry]:
        return self._local.lru(limit)

    def stamped(self) -> list[tuple[Entry, int]]:
        return self._local.stamped()

    def layout_counts(self) -> dict[bytes, int]:
        return self._local.layout_counts()

    def rebuild(self, entries: Iterable[Entry]) -> None:
        self._local.rebuild(entries)

    def close(self) -> None:
        self._sweeper.stop()

    # -- the shared budget ---------------------------------------------------

    def sweep(self) -> bool:
        """One round: hold the lease if it is free, lapsed or ours, and if held, sweep the
        budget; else read the holder's totals. True if this host holds the lease."""
        record = self._device.read_record(LEASE_RECORD)
        lease = None if record is None else LeaseBody.decode(record.body)
        held_by_another = record is not None and lease is not None and lease.holder != self.holder
        if held_by_another and record is not None and record.age_s < self.settings.lease_s:
            self._shared = lease
            return False
        renewed_at_s = time.monotonic()
        etag = self._write_lease(lease or LeaseBody(self.holder), record)
        if etag is None:
            return False
        self._once.clear(f"lease:{self.tier_name}")
        totals = self._keep_budget(lease or LeaseBody(self.holder), renewed_at_s)
        self._shared = totals
        self._write_lease(totals, Record(b"", etag, 0.0))
        return True

    def _write_lease(self, lease: LeaseBody, record: Record | None) -> str | None:
        """Write ``lease`` as ours over ``record`` (None: create it); None if another host won."""
        ours = LeaseBody(self.holder, lease.used_bytes, lease.objects, lease.evicted)
        try:
            return self._device.write_record(LEASE_RECORD, ours.encode(), None if record is None else record.etag)
        except PreconditionFailed:
            return None

    def _keep_budget(self, lease: LeaseBody, renewed_at_s: float) -> LeaseBody:
        """List the tier, delete the oldest values above the budget, abort abandoned uploads."""
        objects = sorted(self._device.listing(), key=lambda stored: stored.modified_s)
        used = sum(stored.nbytes for stored in objects)
        victims: list[StoredObject] = []
        for stored in objects:
            if used <= self.settings.capacity_bytes:
                break
            victims.append(stored)
            used -= stored.nbytes
        if victims and time.monotonic() - renewed_at_s < self.settings.lease_s / 2:
            self._device.delete_many([victim.key for victim in victims])
            self._local.remove([victim.key for victim in victims])
            for victim in victims:
                self._count_eviction(victim.nbytes)
            _log.info(
                "kvharbor: tier %s: %d values evicted to keep the shared budget of %g GiB",
                self.tier_name,
                len(victims),
                self.settings.capacity_bytes / 2**30,
            )
        else:
            used += sum(victim.nbytes for victim in victims)
            victims = []
        aborted = self._device.abort_uploads(self.settings.abandoned_upload_s)
        if aborted:
            _log.info("kvharbor: tier %s: %d abandoned uploads aborted", self.tier_name, aborted)
        return LeaseBody(self.holder, used, len(objects) - len(victims), lease.evicted + len(victims))

    def _sweep_round(self) -> None:
        """One background `sweep`: a fault is said once (it recurs each round), not raised."""
        try:
            self.sweep()
        except DeviceError as err:
            self._once.say(
                f"lease:{self.tier_name}",
                f"tier '{self.tier_name}': the shared budget could not be kept this round ({err}); trying again",
            )

    def _remember(self, entry: Entry) -> None:
        """Know ``entry`` is stored. What this host knows is bounded by the tier's budget:
        past it the entries it used least recently are forgotten here (only here: their
        objects stay, and a lookup asks the store for them again)."""
        self._local.admit(entry, self.settings.capacity_bytes)

    def _remember_absent(self, keys: Sequence[bytes], now_s: float) -> None:
        if not keys or self.settings.miss_ttl_s <= 0:
            return
        until_s = now_s + self.settings.miss_ttl_s
        with self._absent_lock:
            if len(self._absent) + len(keys) > ABSENT_ENTRIES_MAX:
                self._absent = {key: until for key, until in self._absent.items() if until > now_s}
            for key in keys:
                self._absent[bytes(key)] = until_s


def _uncounted(_nbytes: int) -> None:
    return None
