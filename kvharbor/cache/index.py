"""What a tier knows it holds: key, size, last access — and its byte budget.

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
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    nbytes: int
    """Bytes on the device, headers and every fragment included."""
    parts: int
    """How many device objects hold the value (fragments)."""


class OverBudget(Exception):
    """A single value larger than the tier's whole budget."""


class TierIndex(ABC):
    @abstractmethod
    def admit(self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes] = frozenset()) -> list[Entry]:
        """Record ``entry`` and return the least recently used entries to evict.

        The returned victims are already gone from the index; the caller deletes
        their bytes. ``pinned`` keys are never chosen (e.g. the chunks of the
        request being written). Raises `OverBudget` if ``entry`` alone exceeds
        the budget; then nothing changes.
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

    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def count(self) -> int: ...

    @abstractmethod
    def lru(self, limit: int) -> list[Entry]:
        """Up to ``limit`` entries, least recently used first."""

    @abstractmethod
    def rebuild(self, entries: Iterable[Entry]) -> None:
        """Replace the whole index (recovery from a device scan)."""

    def close(self) -> None:  # noqa: B027 - the memory index holds no handles.
        pass


def check_admission(entry: Entry, budget_bytes: int) -> None:
    assert entry.nbytes > 0 and entry.parts >= 1, entry
    if entry.nbytes > budget_bytes:
        raise OverBudget(f"a value of {entry.nbytes} bytes exceeds the tier budget of {budget_bytes}")


class MemoryIndex(TierIndex):
    """An LRU index in one process; the order of the dict is the LRU order."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._used_bytes = 0
        self._lock = threading.Lock()

    def admit(self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes] = frozenset()) -> list[Entry]:
        check_admission(entry, budget_bytes)
        with self._lock:
            old = self._entries.get(entry.key)
            used = self._used_bytes - (old.nbytes if old is not None else 0)
            # Choose first, change after: a refusal must leave the index as it was.
            victims: list[Entry] = []
            for key, candidate in self._entries.items():
                if used + entry.nbytes <= budget_bytes:
                    break
                if key in pinned or key == entry.key:
                    continue
                victims.append(candidate)
                used -= candidate.nbytes
            if used + entry.nbytes > budget_bytes:
                raise OverBudget(f"{entry.nbytes} bytes do not fit the budget of {budget_bytes}: the rest is pinned")
            for victim in victims:
                del self._entries[victim.key]
            self._entries.pop(entry.key, None)
            self._entries[entry.key] = entry
            self._used_bytes = used + entry.nbytes
        assert 0 < self._used_bytes <= budget_bytes
        return victims

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._used_bytes -= entry.nbytes

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        entries = self._entries
        return [k in entries for k in keys]

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def used_bytes(self) -> int:
        return self._used_bytes

    def count(self) -> int:
        return len(self._entries)

    def lru(self, limit: int) -> list[Entry]:
        with self._lock:
            out: list[Entry] = []
            for entry in self._entries.values():
                if len(out) >= limit:
                    break
                out.append(entry)
            return out

    def rebuild(self, entries: Iterable[Entry]) -> None:
        with self._lock:
            self._entries.clear()
            self._used_bytes = 0
            for entry in entries:
                self._entries[entry.key] = entry
                self._used_bytes += entry.nbytes
