"""What a tier knows it holds: key, size, last access — and its byte budget.

The budget counts what each value takes on its device (`Entry.allocated_bytes`: its
bytes and the device's rounding of them, `kvharbor.hal.base.Device.allocation_bytes`),
not its bytes alone: a tier whose values are small beside the device's unit of
allocation would otherwise evict while its figures said it was half empty, or promise
room its device does not have.

The index, not the device, decides eviction: a device only stores bytes. Two
kinds exist: `MemoryIndex` for tiers that live and die with one process (RAM),
and the SQLite manifest (`kvharbor.cache.manifest`) for tiers that outlive it
and are shared by several processes (files), where the budget must hold for
the whole directory, not per process.

Contract: `admit` is atomic with respect to every other user of the same
index. It records the new entry and picks LRU victims in one step, so two
writers can never both see room that only one of them has.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvharbor.hal.keytable import NO_RECORD, KeyTable


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    nbytes: int
    """Bytes on the device, headers and every fragment included."""
    parts: int
    """How many device objects hold the value (fragments)."""
    fingerprint: bytes = b""
    """The layout fingerprint the value is stored under (its header's), which the index
    counts objects by (`TierIndex.layout_counts`); empty where a caller has none to give
    (tools and tests that build an index by hand): counted under the empty fingerprint."""
    slack_bytes: int = 0
    """What the device takes beyond ``nbytes`` (its rounding of every part, see
    `kvharbor.hal.base.Device.allocation_bytes`); below `SLACK_BYTES_MAX`."""

    @property
    def allocated_bytes(self) -> int:
        """What the value takes on the device: what a budget counts."""
        return self.nbytes + self.slack_bytes


class OverBudget(Exception):
    """A single value larger than the tier's whole budget."""


class TierIndex(ABC):
    @abstractmethod
    def admit(
        self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes] = frozenset(), behind: bool = False
    ) -> list[Entry]:
        """Record ``entry`` and return the least recently used entries to evict.

        The returned victims are already gone from the index; the caller deletes
        their bytes. ``pinned`` keys are never chosen (e.g. the chunks of the
        request being written). Raises `OverBudget` if ``entry`` alone exceeds
        the budget; then nothing changes.

        ``behind``: record ``entry`` as the *least* recently used, and only into
        free room: nothing is evicted (`OverBudget` instead), and a key already
        here is left as it is (no victims). A refill copies objects older than
        everything engines use now; they must go first, not push those out.
        """

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as just used."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None: ...

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get(self, key: bytes) -> Entry | None: ...

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key, its `Entry.nbytes`, or None when absent."""
        return [None if (entry := self.get(key)) is None else entry.nbytes for key in keys]

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the entries (`Entry.nbytes`)."""

    def allocated_bytes(self) -> int:
        """What the entries take on the device (`Entry.allocated_bytes`): what the budget
        counts. The default is for indexes that keep no slack (the manifest, the shared
        index: their devices' values take their bytes)."""
        return self.used_bytes()

    @abstractmethod
    def count(self) -> int: ...

    @abstractmethod
    def lru(self, limit: int) -> list[Entry]:
        """Up to ``limit`` entries, least recently used first."""

    @abstractmethod
    def stamped(self) -> list[tuple[Entry, int]]:
        """Every entry with when it was last stored or used in this index, in wall-clock
        nanoseconds (`kvharbor purge --older-than`); a snapshot, in no set order."""

    @abstractmethod
    def layout_counts(self) -> dict[bytes, int]:
        """How many entries are stored under each stored fingerprint, for those with any;
        exact, kept as entries come and go (no scan)."""

    @abstractmethod
    def rebuild(self, entries: Iterable[Entry]) -> None:
        """Replace the whole index (recovery from a device scan)."""

    def close(self) -> None:  # noqa: B027 - the memory index holds no handles.
        pass


SLACK_BYTES_MAX = 1 << 32
"""An entry's slack is below this (a 32-bit field of `MemoryIndex`): each part's rounding is
below a page or slab slot, and a value has at most `kvharbor.cache.format.FRAGMENTS_MAX` parts."""


def check_entry(entry: Entry) -> None:
    """Raise ValueError for an entry an index cannot hold (its slack out of range)."""
    assert entry.nbytes > 0 and entry.parts >= 1, entry
    if not 0 <= entry.slack_bytes < SLACK_BYTES_MAX:
        raise ValueError(f"an entry's slack of {entry.slack_bytes} bytes is outside 0..{SLACK_BYTES_MAX - 1}")


def check_admission(entry: Entry, budget_bytes: int) -> None:
    """`check_entry`, and `OverBudget` for a value that alone takes more than the budget."""
    check_entry(entry)
    if entry.allocated_bytes > budget_bytes:
        raise OverBudget(
            f"a value taking {entry.allocated_bytes} bytes ({entry.nbytes} of its own) exceeds the tier budget "
            f"of {budget_bytes}"
        )


_NBYTES = 0
_PARTS = 1
_OLDER = 2
"""The next less recently used record, or `_LRU_END`."""
_NEWER = 3
"""The next more recently used record, or `_LRU_END`."""
_USED_S = 4
"""When the entry was last stored or used, in whole wall-clock seconds (fits 32 bits until
2106); an entry rebuilt from a device scan is stamped at the rebuild: used then at the latest."""
_LAYOUT = 5
"""The ordinal of the entry's fingerprint in the index's layout table."""
_SLACK = 6
"""`Entry.slack_bytes`."""
_FIELDS = "QIIIIHI"
"""64 bits for the size, 32 for the fragment count (at most `FRAGMENTS_MAX`), the links
(record ids fit in 31 bits) and the last use, 16 for the layout ordinal, 32 for the slack
(`SLACK_BYTES_MAX`)."""
LAYOUTS_MAX = 1 << 16
"""Distinct fingerprints one `MemoryIndex` can tell apart (a 16-bit ordinal per entry); an
ordinal whose last entry left is reused."""


def _now_s() -> int:
    return int(time.time())


_LRU_END = (1 << 32) - 1
"""Ends the LRU list: never a record id, and it fits an unsigned 64-bit field."""


class MemoryIndex(TierIndex):
    """An LRU index in one process, in a `KeyTable`: about 55 bytes per key.

    Each key's record holds its size, its fragment count, its two neighbours
    in a doubly linked LRU list threaded through the record ids, least recently
    used at ``_oldest``, and the ordinal of its fingerprint in a small layout
    table beside it (a process sees a few layouts, not one per key), which also
    counts the entries of each. Every call takes the lock: a concurrent insert
    may rehash the table or reuse a freed record under a reader.
    """

    def __init__(self) -> None:
        self._table = KeyTable(_FIELDS)
        self._oldest = _LRU_END
        self._newest = _LRU_END
        self._used_bytes = 0
        self._allocated_bytes = 0
        self._layouts = _LayoutTable()
        self._lock = threading.Lock()

    def admit(
        self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes] = frozenset(), behind: bool = False
    ) -> list[Entry]:
        check_admission(entry, budget_bytes)
        with self._lock:
            table = self._table
            own = table.find(entry.key)
            if behind:
                self._admit_behind(entry, own, budget_bytes)
                return []
            taken = self._allocated_bytes - (self._allocated(own) if own != NO_RECORD else 0)
            need = entry.allocated_bytes
            # Choose first, change after: a refusal must leave the index as it was.
            victims: list[Entry] = []
            record = self._oldest
            while record != _LRU_END and taken + need > budget_bytes:
                if record != own:
                    key = table.key_of(record)
                    if key not in pinned:
                        victim = self._entry(record)
                        victims.append(victim)
                        taken -= victim.allocated_bytes
                record = table.get(record, _NEWER)
            if taken + need > budget_bytes:
                raise OverBudget(f"{need} bytes do not fit the budget of {budget_bytes}: the rest is pinned")
            self._layouts.check_room(entry.fingerprint)
            for victim in victims:
                self._forget(victim.key)
            if own == NO_RECORD:
                own = table.insert(entry.key)
            else:
                self._unlink(own)
                self._uncount(own)
            self._fill(own, entry, _now_s())
            self._link_newest(own)
            assert self._allocated_bytes == taken + need, (self._allocated_bytes, taken, need)
        assert 0 < self._allocated_bytes <= budget_bytes
        return victims

    def touch(self, keys: Sequence[bytes]) -> None:
        now_s = _now_s()
        with self._lock:
            table = self._table
            for key in keys:
                record = table.find(key)
                if record == NO_RECORD:
                    continue
                table.set(record, _USED_S, now_s)
                if record != self._newest:
                    self._unlink(record)
                    self._link_newest(record)

    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._forget(key)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            find = self._table.find
            return [find(key) != NO_RECORD for key in keys]

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            record = self._table.find(key)
            return None if record == NO_RECORD else self._entry(record)

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        # One lock and no Entry per key: a lookup of a long prompt asks this for every chunk.
        with self._lock:
            find, get = self._table.find, self._table.get
            return [None if (record := find(key)) == NO_RECORD else get(record, _NBYTES) for key in keys]

    def used_bytes(self) -> int:
        return self._used_bytes

    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    def count(self) -> int:
        return len(self._table)

    def lru(self, limit: int) -> list[Entry]:
        with self._lock:
            out: list[Entry] = []
            record = self._oldest
            while record != _LRU_END and len(out) < limit:
                out.append(self._entry(record))
                record = self._table.get(record, _NEWER)
            return out

    def layout_counts(self) -> dict[bytes, int]:
        with self._lock:
            return self._layouts.counts()

    def stamped(self) -> list[tuple[Entry, int]]:
        with self._lock:
            table = self._table
            return [(self._entry(record), table.get(record, _USED_S) * 1_000_000_000) for _, record in table]

    def rebuild(self, entries: Iterable[Entry]) -> None:
        now_s = _now_s()
        with self._lock:
            # A fresh table, not emptied arrays: the memory of a larger past goes back.
            self._table = KeyTable(_FIELDS)
            self._oldest = self._newest = _LRU_END
            self._used_bytes = self._allocated_bytes = 0
            self._layouts = _LayoutTable()
            for entry in entries:
                check_entry(entry)
                # A repeated key replaces the earlier entry where it stood, as dict assignment does.
                self._layouts.check_room(entry.fingerprint)
                record = self._table.find(entry.key)
                if record == NO_RECORD:
                    record = self._table.insert(entry.key)
                    self._link_newest(record)
                else:
                    self._uncount(record)
                self._fill(record, entry, now_s)

    # -- internals, under the lock -------------------------------------------

    def _admit_behind(self, entry: Entry, own: int, budget_bytes: int) -> None:
        """`admit` with ``behind`` (see there)."""
        if own != NO_RECORD:
            return
        if self._allocated_bytes + entry.allocated_bytes > budget_bytes:
            raise OverBudget(f"{entry.allocated_bytes} bytes do not fit the free room of the budget of {budget_bytes}")
        self._layouts.check_room(entry.fingerprint)
        record = self._table.insert(entry.key)
        self._fill(record, entry, _now_s())
        self._link_oldest(record)

    def _fill(self, record: int, entry: Entry, used_s: int) -> None:
        """Write ``entry`` into ``record`` (new, or one whose layout was released) and count
        it: its bytes in the total, itself under its fingerprint."""
        table = self._table
        table.set(record, _NBYTES, entry.nbytes)
        table.set(record, _PARTS, entry.parts)
        table.set(record, _USED_S, used_s)
        table.set(record, _LAYOUT, self._layouts.hold(entry.fingerprint))
        table.set(record, _SLACK, entry.slack_bytes)
        self._used_bytes += entry.nbytes
        self._allocated_bytes += entry.allocated_bytes

    def _uncount(self, record: int) -> None:
        """Take ``record``'s entry out of the totals and its layout's count (it is being
        replaced or forgotten)."""
        table = self._table
        self._used_bytes -= table.get(record, _NBYTES)
        self._allocated_bytes -= self._allocated(record)
        assert 0 <= self._used_bytes <= self._allocated_bytes, (self._used_bytes, self._allocated_bytes)
        self._layouts.release(table.get(record, _LAYOUT))

    def _allocated(self, record: int) -> int:
        return self._table.get(record, _NBYTES) + self._table.get(record, _SLACK)

    def _entry(self, record: int) -> Entry:
        table = self._table
        fingerprint = self._layouts.fingerprint(table.get(record, _LAYOUT))
        return Entry(
            table.key_of(record), table.get(record, _NBYTES), table.get(record, _PARTS), fingerprint,
            table.get(record, _SLACK),
        )  # fmt: skip

    def _forget(self, key: bytes) -> None:
        """Drop ``key`` if present."""
        record = self._table.detach(key)
        if record == NO_RECORD:
            return
        self._uncount(record)
        self._unlink(record)
        self._table.release(record)

    def _unlink(self, record: int) -> None:
        table = self._table
        older, newer = table.get(record, _OLDER), table.get(record, _NEWER)
        if older == _LRU_END:
            assert self._oldest == record, (self._oldest, record)
            self._oldest = newer
        else:
            table.set(older, _NEWER, newer)
        if newer == _LRU_END:
            assert self._newest == record, (self._newest, record)
            self._newest = older
        else:
            table.set(newer, _OLDER, older)

    def _link_oldest(self, record: int) -> None:
        table = self._table
        table.set(record, _OLDER, _LRU_END)
        table.set(record, _NEWER, self._oldest)
        if self._oldest == _LRU_END:
            self._newest = record
        else:
            table.set(self._oldest, _OLDER, record)
        self._oldest = record

    def _link_newest(self, record: int) -> None:
        table = self._table
        table.set(record, _OLDER, self._newest)
        table.set(record, _NEWER, _LRU_END)
        if self._newest == _LRU_END:
            self._oldest = record
        else:
            table.set(self._newest, _NEWER, record)
        self._newest = record


class _LayoutTable:
    """Ordinal -> stored fingerprint, and how many entries hold each ordinal: what a
    `MemoryIndex` record keeps of its fingerprint in 2 bytes instead of 16. Not
    thread-safe: the index's lock covers it."""

    def __init__(self) -> None:
        self._fingerprints: list[bytes] = []
        self._counts: list[int] = []
        self._ordinals: dict[bytes, int] = {}
        self._unused: list[int] = []
        """Ordinals whose count fell to zero, reused before the table grows."""

    def check_room(self, fingerprint: bytes) -> None:
        """Raise `OverBudget` when ``fingerprint`` would need an ordinal and none is left:
        called before an admission changes anything."""
        if fingerprint not in self._ordinals and not self._unused and len(self._fingerprints) >= LAYOUTS_MAX:
            raise OverBudget(f"the index already tells {LAYOUTS_MAX} layouts apart: no ordinal for another")

    def hold(self, fingerprint: bytes) -> int:
        """Count one more entry under ``fingerprint``; its ordinal (see `check_room`)."""
        ordinal = self._ordinals.get(fingerprint)
        if ordinal is None:
            fingerprint = bytes(fingerprint)
            if self._unused:
                ordinal = self._unused.pop()
                self._fingerprints[ordinal] = fingerprint
            else:
                ordinal = len(self._fingerprints)
                self._fingerprints.append(fingerprint)
                self._counts.append(0)
            self._ordinals[fingerprint] = ordinal
        self._counts[ordinal] += 1
        return ordinal

    def release(self, ordinal: int) -> None:
        """Count one entry fewer under ``ordinal``; its last frees the ordinal."""
        self._counts[ordinal] -= 1
        if self._counts[ordinal] < 0:
            raise RuntimeError(f"layout ordinal {ordinal} released more often than held")
        if self._counts[ordinal] == 0:
            del self._ordinals[self._fingerprints[ordinal]]
            self._unused.append(ordinal)

    def fingerprint(self, ordinal: int) -> bytes:
        return self._fingerprints[ordinal]

    def counts(self) -> dict[bytes, int]:
        return {fingerprint: self._counts[ordinal] for fingerprint, ordinal in self._ordinals.items()}
