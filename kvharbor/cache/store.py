"""The tiered store: ordered tiers searched top-down, one verified object format.

Contracts:

- `lookup` answers how many *leading* keys are stored somewhere, in one
  batched index query per tier. Keys are prefix-chained, so the first miss ends
  the usable prefix. `probe` says as well how many of them are resident (see
  `Tier.resident`): those can be promised as they are; `verify` reads the
  others back in full before anyone promises them.
- `get` searches tiers top-down and promotes a hit into the tiers above it.
- `put` writes the first tier, and then either every lower tier now
  (write-through) or each lower tier when the one above evicts (write-back).
  The first tier is always written before `put` returns; a lower tier with
  asynchronous writes (`AsyncWrites`) is handed a copy through its
  `WriteQueue` instead (a full queue drops the write: the caller never waits
  for a slow tier). A key queued for a tier and not yet written there is a hit,
  served from the queue's copy; a delete cancels its queued writes. `close`
  writes the queues out within `AsyncWrites.shutdown_deadline_s`.
  `reserve` and `complete` are a put in two phases whose value is written by
  the caller straight into its place in the first tier (a shared-memory tier):
  no copy of it is made to store it there.
- Nothing here raises for a storage fault: a fault is a miss, counted and
  logged once by the tier; a corrupt object is a miss and is dropped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from kvharbor.cache.index import Entry
from kvharbor.cache.namespaces import NamespaceTags
from kvharbor.cache.tier import BufferSource, Reservation, SharedHit, Tier, TierStatus, new_buffer
from kvharbor.cache.writequeue import WriteQueue, WriteQueueSettings
from kvharbor.hal.base import Buffer
from kvharbor.telemetry.log import OnceLog, get_logger
from kvharbor.telemetry.metrics import HitCounts, HitMetrics

_log = get_logger("kvharbor.cache.store")

WritePolicy = Literal["write_through", "write_back"]


@dataclass(frozen=True, slots=True)
class StoreStatus:
    tiers: list[TierStatus]
    write_policy: str
    hits: HitCounts = field(default_factory=HitCounts)
    skipped: dict[str, str] = field(default_factory=dict)
    """Configured tiers that did not open, by name: why (``probe failed: ...``, ``unavailable: ...``)."""


@dataclass(frozen=True, slots=True)
class AsyncWrites:
    """Which tiers are written through a queue, and the queues' limits (``storage.async_*``)."""

    tiers: frozenset[str]
    """Names of the tiers with ``async_writes``; the store's first tier is written at once whatever it says."""
    queue: WriteQueueSettings
    shutdown_deadline_s: float
    """How long `TieredStore.close` writes the queues out before it gives up on what is left."""


@dataclass(frozen=True, slots=True)
class Probe:
    """What a `TieredStore.probe` found."""

    hits: int
    """Leading keys some tier holds."""
    resident: int
    """Of those, the leading ones a resident tier holds as values of the asked size."""


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        write_policy: WritePolicy = "write_through",
        hits: HitMetrics | None = None,
        skipped: Mapping[str, str] | None = None,
        async_writes: AsyncWrites | None = None,
    ) -> None:
        """``hits``: where lookups are counted in tokens (the gateway's metrics); a
        registry of its own without. ``skipped``: configured tiers that did not open,
        and why (shown in `status`). ``async_writes``: the tiers written through a queue
        (none without)."""
        names = [t.name for t in tiers]
        assert len(set(names)) == len(names), names
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.hits = hits if hits is not None else HitMetrics.standalone()
        self.skipped = dict(skipped or {})
        self.namespaces = NamespaceTags()
        """One for all tiers: a copy between tiers records what its writer said."""
        for tier in self.tiers:
            tier.namespaces = self.namespaces
        self._closed = False
        self._close_lock = threading.Lock()
        self._once = OnceLog(_log)
        self._shutdown_deadline_s = async_writes.shutdown_deadline_s if async_writes else 0.0
        self.queues: dict[str, WriteQueue] = {}
        """Tier name -> its write queue, for the tiers written asynchronously (never the first)."""
        for tier in self.tiers[1:]:
            if async_writes is not None and tier.name in async_writes.tiers:
                self.queues[tier.name] = WriteQueue(
                    tier.name, async_writes.queue, partial(self._write_now, tier), tier.delete, tier.metrics
                )

    # -- queries -----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], chunk_tokens: int = 0) -> int:
        """How many leading ``keys`` some tier holds.

        ``chunk_tokens`` (tokens per key) only feeds hit accounting in tokens.
        """
        return self.probe(keys, chunk_tokens).hits

    def probe(self, keys: Sequence[bytes], chunk_tokens: int = 0, value_bytes: int = 0) -> Probe:
        """`lookup`, and how many leading hits the first tier holds as resident values
        (`Tier.resident`) of ``value_bytes`` (0: of any size): those need no reading back
        before a promise.

        A key the first, resident tier holds as a value of another size is not a hit:
        that tier is the one a get reads, and the value would fill no chunk of this layout.
        """
        if not keys:
            return Probe(0, 0)
        resident = 0
        first = self.tiers[0] if self.tiers else None
        wrong_size = False
        if first is not None and first.resident:
            # The first tier's index answers presence too: a prompt all in RAM costs one
            # index query, as a plain lookup does.
            for size in first.value_sizes(keys):
                if size is None:
                    break  # Not there: held below (read back before a promise), or a miss.
                if value_bytes and size != value_bytes:
                    wrong_size = True
                    break
                resident += 1
        rest = [] if wrong_size else keys[resident:]
        present = self.contains(rest) if rest else []
        hits = resident + next((i for i, p in enumerate(present) if not p), len(rest))
        assert 0 <= resident <= hits <= len(keys)
        self.hits.record(len(keys) * chunk_tokens, hits * chunk_tokens)
        return Probe(hits, resident)

    def verify(
        self,
        items: Sequence[tuple[bytes, bytes]],
        value_bytes: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """How many leading (fingerprint, key) ``items`` are stored intact, as values of
        ``value_bytes`` (0: of any size), each read back in full.

        A read is a `get`: verified against its checksums (a damaged value is dropped
        and is a miss) and promoted into the tiers above, so that the load that follows
        reads memory. A value of another size is dropped as well: under its key it can
        fill nobody's chunk. ``progress(done)`` hears after each item.
        """
        for done, (fingerprint, key) in enumerate(items):
            value = self.get(key, fingerprint, touch=False)
            if value is None:
                return done
            if value_bytes and value.nbytes != value_bytes:
                self._once.say(
                    "wrong-size",
                    f"chunk {key.hex()} holds {value.nbytes} bytes where its layout needs {value_bytes}; "
                    "dropped, a miss (said once)",
                )
                self.delete([key])
                return done
            if progress is not None:
                progress(done + 1)
        return len(items)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: does any tier hold it, or a tier's queue?"""
        present = [False] * len(keys)
        for tier in self.tiers:
            present = [a or b for a, b in zip(present, tier.contains(keys), strict=True)]
        for queue in self.queues.values():
            present = [a or b for a, b in zip(present, queue.holds(keys), strict=True)]
        return present

    def get(
        self, key: bytes, fingerprint: bytes, source: BufferSource = new_buffer, touch: bool = True
    ) -> memoryview | None:
        """The verified value, or None; a hit below the first tier is promoted.

        ``source`` supplies the buffer the stored object is read into (see
        `Tier.read`); ``touch=False`` leaves recency to a later `touch`.
        """
        for depth, tier in enumerate(self.tiers):
            value = tier.read(key, fingerprint, source, touch)
            queue = self.queues.get(tier.name)
            if value is None and queue is not None:
                value = queue.pending(key, fingerprint)  # Evicted above, not written here yet.
            if value is None:
                continue
            for upper in reversed(self.tiers[:depth]):
                self._write_tier(upper, key, fingerprint, value)
            return value
        return None

    def get_shared(self, key: bytes, fingerprint: bytes, touch: bool = True) -> SharedHit | None:
        """``key``'s value in place in shared memory, when the first tier holding it
        is a shared-memory tier that can serve it so; else None (use `get`)."""
        for tier in self.tiers:
            if tier.contains([key])[0]:
                return tier.read_shared(key, fingerprint, touch)
        return None

    def get_shared_run(self, keys: Sequence[bytes], fingerprint: bytes) -> list[SharedHit]:
        """The leading ``keys`` the first tier holds and serves in place, pinned (see
        `Tier.read_shared_run`; recency left to a later `touch`): a caller goes on from the
        first key not among them with `get_shared` and `get`."""
        if not self.tiers:
            return []
        first = self.tiers[0]
        held = first.contains(keys)
        leading = held.index(False) if False in held else len(held)
        return first.read_shared_run(keys[:leading], fingerprint)

    # -- updates -----------------------------------------------------------

    def put(
        self,
        key: bytes,
        fingerprint: bytes,
        value: Buffer,
        pinned: frozenset[bytes] = frozenset(),
        value_checksum: int | None = None,
    ) -> bool:
        """Store ``value`` under ``key``; True if at least one tier took it.

        ``pinned`` keys are not evicted to make room (the caller's own chunks).
        ``value_checksum``: the value's checksum when the caller has it (see `Tier.write`).
        """
        targets = self.tiers if self.write_policy == "write_through" else self.tiers[:1]
        stored = False
        for tier in targets:
            stored |= self._write_tier(tier, key, fingerprint, value, pinned, value_checksum=value_checksum)
        return stored

    def reserve(
        self, key: bytes, fingerprint: bytes, nbytes: int, pinned: frozenset[bytes] = frozenset()
    ) -> Reservation | None:
        """Room to write ``key``'s value of ``nbytes`` in place in the first tier, or None:
        then store it with `put` (see `Tier.reserve` for why there may be none)."""
        return self.tiers[0].reserve(key, fingerprint, nbytes, pinned) if self.tiers else None

    def complete(
        self, reservation: Reservation, pinned: frozenset[bytes] = frozenset(), value_checksum: int | None = None
    ) -> bool:
        """Store a filled reservation (see `put` for ``pinned``, `Tier.complete` for
        ``value_checksum``); True if a tier took it.

        Write-through copies go first, while the reservation is still invisible to
        everyone else: once the first tier has it, another writer's admission
        could evict it and hand its room to a new value mid-copy.
        """
        first = self.tiers[0]
        assert reservation.tier is first
        stored = False
        if self.write_policy == "write_through":
            for tier in self.tiers[1:]:
                stored |= self._write_tier(
                    tier, reservation.key, reservation.fingerprint, reservation.payload, pinned,
                    value_checksum=value_checksum,
                )  # fmt: skip
        return first.complete(reservation, pinned, self._on_evict(first), value_checksum) or stored

    def abandon(self, reservation: Reservation) -> None:
        reservation.tier.abandon(reservation)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` used, the last most recently, in every tier that holds them.

        Callers touch a prefix chain tail-first, so its head is evicted last:
        evicting chunk 0 first would make every later chunk unreachable.
        """
        for tier in self.tiers:
            tier.touch(keys)

    def delete(self, keys: Sequence[bytes]) -> None:
        for queue in self.queues.values():
            queue.cancel(keys)  # First: a queued write must not bring a deleted key back.
        for tier in self.tiers:
            tier.delete(keys)

    def clear(self) -> int:
        """Empty every tier (``--start-clean=1``); returns the objects removed."""
        return sum(tier.clear() for tier in self.tiers)

    def settle(self, timeout_s: float) -> bool:
        """Wait until the write queues have written what they hold, at most ``timeout_s``
        (before a purge, which reads the tiers themselves); True if they did."""
        deadline = time.monotonic() + timeout_s
        return all(queue.settle(max(0.0, deadline - time.monotonic())) for queue in self.queues.values())

    def status(self) -> StoreStatus:
        tiers = []
        for tier in self.tiers:
            queue = self.queues.get(tier.name)
            status = tier.status()
            tiers.append(status if queue is None else dataclasses.replace(status, write_queue=queue.status()))
        return StoreStatus(
            tiers=tiers,
            write_policy=self.write_policy,
            hits=self.hits.snapshot(),
            skipped=dict(self.skipped),
        )

    def close(self) -> None:
        """Write the queues out (all at once, within the shutdown deadline), then close the tiers."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + self._shutdown_deadline_s
        for queue in self.queues.values():
            queue.begin_close()  # Every queue flushes at once, not one after the other.
        queued = {name: queue.status().depth for name, queue in self.queues.items()}
        if any(queued.values()):
            _log.info(
                "kvharbor: writing out queued writes before the tiers close (%s), for at most %g s "
                "(storage.async_shutdown_deadline_s)",
                ", ".join(f"{name} {depth}" for name, depth in queued.items() if depth),
                self._shutdown_deadline_s,
            )
        for queue in self.queues.values():
            queue.close(deadline)
        for tier in self.tiers:
            tier.close()

    # -- internals ---------------------------------------------------------

    def _write_tier(
        self,
        tier: Tier,
        key: bytes,
        fingerprint: bytes,
        value: Buffer,
        pinned: frozenset[bytes] = frozenset(),
        owned: bool = False,
        value_checksum: int | None = None,
    ) -> bool:
        """Write ``tier`` now, or queue the write when it is written asynchronously (True:
        queued). ``owned``: ``value`` is a copy of the caller's to give away (see
        `WriteQueue.offer`); a queued write keeps only its own key from eviction.
        ``value_checksum``: the value's checksum when the caller has it (see `Tier.write`)."""
        queue = self.queues.get(tier.name)
        if queue is not None:
            return queue.offer(key, fingerprint, value, owned, value_checksum)
        return self._write_now(tier, key, fingerprint, value, value_checksum, pinned)

    def _write_now(
        self,
        tier: Tier,
        key: bytes,
        fingerprint: bytes,
        value: Buffer,
        value_checksum: int | None = None,
        pinned: frozenset[bytes] = frozenset(),
    ) -> bool:
        return tier.write(
            key,
            fingerprint,
            value,
            pinned if key in pinned else pinned | {bytes(key)},
            self._on_evict(tier),
            value_checksum=value_checksum,
        )

    def _on_evict(self, tier: Tier) -> Callable[[Sequence[Entry]], None] | None:
        """Write-back demotes what ``tier`` evicts; write-through has it below already."""
        return partial(self._demote, tier) if self.write_policy == "write_back" else None

    def _demote(self, tier: Tier, victims: Sequence[Entry]) -> None:
        """Write-back: move what ``tier`` evicts into the tier below it, if any."""
        position = self.tiers.index(tier)
        if position + 1 >= len(self.tiers):
            return
        below = self.tiers[position + 1]
        for victim in victims:
            evicted = tier.read_evicted(victim)
            if evicted is not None:
                fingerprint, value = evicted
                self._write_tier(below, victim.key, fingerprint, value, owned=True)  # Read out: ours.
