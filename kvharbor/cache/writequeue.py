"""Asynchronous writes to a slow tier: a bounded queue per tier, served by worker threads.

The store writes its first tier before a put returns (the engine's saves land there);
a lower tier with ``async_writes`` (files, and the object stores and filers to come)
gets its copy from a `WriteQueue` instead, so that a put costs what the first tier
costs, not what the slowest one does.

Contracts:

- **Never blocks.** `WriteQueue.offer` answers at once: a queue holding
  ``depth_max`` values or ``bytes_max`` bytes refuses the write, counts it
  (``kvharbor_tier_async_dropped_total``) and says so once per episode. A dropped
  write is a future miss of that tier, never an error.
- **Nothing queued is lost to the tiers above.** The queue keeps a copy of each
  value it has not written (the tier above may evict it, a client may reuse the
  shared memory it came from), bounded by ``bytes_max``; until the tier has it,
  `pending` serves it from there.
- **A delete wins.** `cancel` takes keys out of the queue, and a write already under
  way for one of them is deleted again once it lands: a dropped or purged chunk is
  never brought back by a write queued before the drop.
- **Shutdown flushes within a deadline.** `close` stops taking writes, lets the
  workers write out what is queued until the deadline, then counts what is left
  (``kvharbor_tier_async_unflushed_total``) and says it once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvharbor.hal.base import Buffer
from kvharbor.telemetry.log import OnceLog, get_logger
from kvharbor.telemetry.metrics import TierMetrics

_log = get_logger("kvharbor.cache.writequeue")

Write = Callable[[bytes, bytes, memoryview, int | None], bool]
"""Writes one value to the queue's tier: (key, fingerprint, value, its checksum if known) -> stored."""
Delete = Callable[[Sequence[bytes]], None]


@dataclass(frozen=True, slots=True)
class WriteQueueSettings:
    """``storage.async_*``: the limits of each tier's queue."""

    depth_max: int
    bytes_max: int
    workers: int

    def __post_init__(self) -> None:
        if self.depth_max <= 0 or self.bytes_max <= 0 or self.workers <= 0:
            raise ValueError(f"write queue limits must be positive: {self}")


@dataclass(frozen=True, slots=True)
class WriteQueueStatus:
    """A tier's write queue now (in `kvharbor.cache.tier.TierStatus`); its counts since start
    are the tier's ``async_*`` counters."""

    depth: int
    """Values queued or being written."""
    nbytes: int
    """Value bytes the queue holds (its copies)."""
    depth_max: int
    bytes_max: int
    workers: int


class _Write:
    """One queued value. Identity matters: a newer write of the key replaces it."""

    __slots__ = ("cancelled", "checksum", "fingerprint", "key", "value")

    def __init__(self, key: bytes, fingerprint: bytes, value: memoryview, checksum: int | None) -> None:
        self.key = key
        self.fingerprint = fingerprint
        self.value = value
        self.checksum = checksum
        """The value's `kvharbor.hal.checksum.checksum` when its writer took it (None: the tier takes it)."""
        self.cancelled = False
        """Deleted while being written: delete it again once it lands."""


class WriteQueue:
    """The queue of one tier's writes and the threads that serve it. Thread-safe.

    A write is *held* (its copy counts against the limits) from `offer` until it is
    neither the newest queued write of its key nor being written.
    """

    def __init__(
        self, tier_name: str, settings: WriteQueueSettings, write: Write, delete: Delete, metrics: TierMetrics
    ) -> None:
        self.tier_name = tier_name
        self.settings = settings
        self._write = write
        self._delete = delete
        self._metrics = metrics
        self._cond = threading.Condition()
        self._order: deque[_Write] = deque()
        """Writes in the order offered; one no longer in ``_pending`` was replaced or cancelled."""
        self._pending: dict[bytes, _Write] = {}
        """The newest write of each key not yet on the tier (one being written included)."""
        self._writing: set[_Write] = set()
        self._held: set[_Write] = set()
        self._nbytes = 0
        """Bytes of the writes in ``_held``."""
        self._closing = False
        self._stopped = False
        self._once = OnceLog(_log)
        metrics.watch_queue(lambda: self.status().depth, lambda: self.status().nbytes)
        self._threads = [
            threading.Thread(target=self._serve, daemon=True, name=f"kvharbor-write-{tier_name}-{n}")
            for n in range(settings.workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- the store's side ---------------------------------------------------

    def offer(
        self, key: bytes, fingerprint: bytes, value: Buffer, owned: bool = False, value_checksum: int | None = None
    ) -> bool:
        """Queue ``value`` for the tier; False (counted, said once) when the queue is full or
        closing. ``owned``: ``value`` is the caller's to give away (a copy nobody else
        writes, a demoted value read out of the tier above), else it is copied here.
        ``value_checksum``: its checksum when the caller has it (see `Tier.write`)."""
        view = memoryview(value).cast("B")
        with self._cond:
            if not self._has_room(view.nbytes):
                self._dropped()
                return False
        # Copied outside the lock: a large copy must not hold up the workers and other writers.
        item = _Write(bytes(key), bytes(fingerprint), view if owned else memoryview(bytes(view)), value_checksum)
        with self._cond:
            if not self._has_room(view.nbytes):  # Others filled it during the copy.
                self._dropped()
                return False
            replaced = self._pending.get(item.key)
            self._pending[item.key] = item
            if replaced is not None:
                self._release(replaced)
            self._held.add(item)
            self._nbytes += view.nbytes
            self._order.append(item)
            self._cond.notify()
        return True

    def pending(self, key: bytes, fingerprint: bytes) -> memoryview | None:
        """The queued value of ``key`` under ``fingerprint`` not yet on the tier, or None."""
        with self._cond:
            item = self._pending.get(key)
        return item.value if item is not None and item.fingerprint == fingerprint else None

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is a write of it queued or under way?"""
        with self._cond:
            return [key in self._pending for key in keys]

    def cancel(self, keys: Sequence[bytes]) -> None:
        """Forget queued writes of ``keys``; one under way is deleted again once it lands
        (the caller deletes what the tier holds already)."""
        gone = set(keys)
        with self._cond:
            for key in gone:
                item = self._pending.pop(key, None)
                if item is not None:
                    self._release(item)
            for item in self._writing:
                if item.key in gone:
                    item.cancelled = True
            self._cond.notify_all()

    def status(self) -> WriteQueueStatus:
        with self._cond:
            depth, nbytes = len(self._held), self._nbytes
        return WriteQueueStatus(depth, nbytes, self.settings.depth_max, self.settings.bytes_max, self.settings.workers)

    def settle(self, timeout_s: float) -> bool:
        """Wait until every queued write is written, at most ``timeout_s``; True if so."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._held:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return False
                self._cond.wait(left_s)
        return True

    def begin_close(self) -> None:
        """Take no more writes; the workers write out what is queued."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self, deadline: float) -> int:
        """Write out the queue until ``deadline`` (a `time.monotonic` instant), then stop
        the workers; returns the writes left unwritten (counted and said once)."""
        self.begin_close()
        self.settle(max(0.0, deadline - time.monotonic()))
        with self._cond:
            left, left_bytes = len(self._held), self._nbytes
            self._stopped = True
            self._order.clear()
            self._pending.clear()
            self._cond.notify_all()
        if left:
            self._metrics.async_unflushed(left)
            self._once.say(
                f"unflushed:{self.tier_name}",
                f"tier '{self.tier_name}': {left} queued write(s) ({left_bytes} bytes) not written within "
                "storage.async_shutdown_deadline_s; lost (future misses of this tier)",
            )
        for thread in self._threads:
            # Each worker ends after its current write; one stuck in a device past the
            # deadline is left behind (a daemon thread): the gateway's exit does not wait.
            thread.join(max(0.0, deadline - time.monotonic()))
        return left

    # -- the workers ---------------------------------------------------------

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            try:
                self._write(item.key, item.fingerprint, item.value, item.checksum)
            except Exception as err:  # A bug below must cost this write, not the worker.
                self._once.say(f"bug:{self.tier_name}", f"tier '{self.tier_name}': a queued write failed: {err!r}")
            self._metrics.async_flushed()
            with self._cond:
                self._writing.discard(item)
                if self._pending.get(item.key) is item:
                    del self._pending[item.key]
                self._release(item)
                drained = not self._held
                self._cond.notify_all()
            if drained:  # A full episode ends when the queue has written everything.
                self._once.clear(f"full:{self.tier_name}", f"tier '{self.tier_name}': write queue drained")
            if item.cancelled:
                self._delete([item.key])

    def _next(self) -> _Write | None:
        """The oldest write still wanted, marked as being written; None once stopped."""
        with self._cond:
            while not self._stopped:
                while self._order:
                    item = self._order.popleft()
                    if self._pending.get(item.key) is item:
                        self._writing.add(item)
                        return item
                if self._closing:
                    return None  # Nothing left to write: a closing queue's workers end.
                self._cond.wait()
            return None

    def _has_room(self, nbytes: int) -> bool:
        """Under the lock: may a write of ``nbytes`` be held now?"""
        return (
            not self._closing
            and len(self._held) < self.settings.depth_max
            and self._nbytes + nbytes <= self.settings.bytes_max
        )

    def _release(self, item: _Write) -> None:
        """Under the lock: stop holding ``item`` once it is neither pending nor being written."""
        if item in self._held and self._pending.get(item.key) is not item and item not in self._writing:
            self._held.discard(item)
            self._nbytes -= item.value.nbytes

    def _dropped(self) -> None:
        self._metrics.async_dropped()
        self._once.say(
            f"full:{self.tier_name}",
            f"tier '{self.tier_name}': write queue full (storage.async_queue_depth {self.settings.depth_max}, "
            f"storage.async_queue_mb {self.settings.bytes_max >> 20}); writes to it are dropped until it drains",
        )
