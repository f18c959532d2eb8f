"""A packed map from 16-byte keys to fixed-width records of unsigned 64-bit fields.

Why: the gateway may hold at most 128 bytes per stored key beyond the values
themselves. A dict of per-key objects costs 200+ bytes per key (the key's bytes
object, the value object, the dict or linked-list node); here a key costs its
16 bytes, 8 bytes per field, one state byte and its share of a slot array of
32-bit record ids — no Python object per key at all.

Layout:

- A record is a small integer id. Its key lives in ``_lo[id]`` and ``_hi[id]``
  (the key's two little-endian 64-bit halves), its fields in
  ``_fields[f][id]`` (a column per field, 64 or 32 bits wide as the owner
  chose), its state in ``_state[id]``.
  Record ids never move: growing the table rehashes slots, not records, so a
  caller may keep an id (e.g. in another record's field) for as long as the
  record lives.
- The table is open addressing with linear probing over ``_slots``, a power of
  two of 32-bit record ids (`NO_RECORD` where empty). Deletion shifts the rest
  of the cluster back instead of leaving tombstones, so any run of inserts and
  deletes leaves the table as if the surviving keys had been inserted afresh:
  probes never lengthen with churn.
- Freed records form a free list threaded through ``_lo`` and are reused before
  the arrays grow.

A record is free, live (its key is in the hash) or detached (its key was
removed from the hash, but the record and its fields stay until `release`):
a device can thus make a replaced value unreachable at once and free its bytes
only when the last reader lets go.

Not thread-safe: the owner serialises every call (the indexes hold a lock).
"""

from __future__ import annotations

import array
import mmap
import struct
import sys
from collections.abc import Iterator
from typing import Literal

KEY_BYTES = 16
"""Every key is exactly this long (a BLAKE2b-128 digest, see `kvharbor.cache.keys`)."""

NO_RECORD = -1
"""What `find`, `detach` and `remove` return for an absent key; also an empty slot."""

LOAD_FACTOR_MAX = 0.7
"""Live keys per slot before the slots double. Linear probing's expected probe
count for a miss is about (1 + 1 / (1 - load)**2) / 2: 6 at 0.7, 50 at 0.9."""

SLOTS_MIN = 8
"""Slots of an empty table (a power of two)."""

RECORDS_MIN = 1024
"""Records a table has room for at first; it doubles when they are all handed out."""

RECORDS_MAX = 2**31 - 1
"""Record ids are stored in 32-bit signed slots ('i')."""

_WORD_MASK = (1 << 64) - 1
_FREE_END = _WORD_MASK
"""Ends the free list; never a record id (those fit in 31 bits)."""

# Record states, one byte per record.
_FREE = 0
_LIVE = 1
_DETACHED = 2


_GOLDEN = 0x9E3779B97F4A7C15
"""2**64 / phi: Fibonacci hashing's multiplier (Knuth, TAOCP 6.4)."""


def _home(lo: int, hi: int, shift: int) -> int:
    """The slot a key hashes to: both halves folded, mixed by a multiply, the top bits
    kept. Product keys are BLAKE2b digests and would do unmixed, but a client may
    send any 16 bytes (tests send counters): keys that differ only in their high
    bytes must not all share one slot and turn every probe into a scan."""
    return (((lo ^ hi) * _GOLDEN) & _WORD_MASK) >> shift


_Typecode = Literal["Q", "I", "H", "B"]
FIELD_TYPES: dict[str, _Typecode] = {"Q": "Q", "I": "I", "H": "H"}
"""A field is an unsigned integer of 64 bits ("Q"), 32 ("I") or 16 ("H"): narrower where
the owner knows its values fit, since every field costs its width for every key."""


def _column(typecode: _Typecode, items: int, old: memoryview | None = None) -> memoryview:
    """``items`` zeroed items of ``typecode`` in a mapping of their own, with ``old``'s
    items copied to its head. A mapping, not the heap: the old one goes back to the
    system whole when dropped (an array regrown by realloc leaves its old copies in
    the process's heap), and pages no record has reached yet take no memory."""
    # Private: counted as the process's own memory (a shared anonymous mapping is shmem).
    column = memoryview(mmap.mmap(-1, items * struct.calcsize(typecode), mmap.MAP_PRIVATE)).cast(typecode)
    if old is not None:
        assert len(old) <= items, (len(old), items)
        column[: len(old)] = old
    return column


class KeyTable:
    """Map of `KEY_BYTES`-byte keys to records of unsigned integer fields."""

    __slots__ = (
        "_count",
        "_fields",
        "_free_head",
        "_grow_at",
        "_hi",
        "_lo",
        "_mask",
        "_mutations",
        "_records",
        "_shift",
        "_slots",
        "_state",
        "_types",
    )

    def __init__(self, fields: str) -> None:
        """``fields``: one `FIELD_TYPES` letter per field, e.g. "QII"."""
        assert set(fields) <= set(FIELD_TYPES), f"field types are Q, I or H (64, 32, 16 bits), got {fields!r}"
        self._types = [FIELD_TYPES[letter] for letter in fields]
        self._records = 0
        """Records ever handed out (ids below it are live, detached or free)."""
        self._lo = _column("Q", RECORDS_MIN)
        self._hi = _column("Q", RECORDS_MIN)
        self._fields = [_column(typecode, RECORDS_MIN) for typecode in self._types]
        self._state = _column("B", RECORDS_MIN)
        self._free_head = _FREE_END
        self._slots = array.array("i", [NO_RECORD]) * SLOTS_MIN
        self._mask = SLOTS_MIN - 1
        self._shift = 64 - (SLOTS_MIN.bit_length() - 1)
        self._grow_at = int(SLOTS_MIN * LOAD_FACTOR_MAX)
        self._count = 0
        self._mutations = 0
        """Counts changes to the hash, so that an iteration can tell it was overtaken."""

    # -- keys ------------------------------------------------------------------

    def find(self, key: bytes) -> int:
        """The live record of ``key``, or `NO_RECORD`."""
        return self._slots[self._probe(key)]

    def __contains__(self, key: bytes) -> bool:
        return self.find(key) != NO_RECORD

    def insert(self, key: bytes) -> int:
        """Add ``key``, which must be absent; returns its new record, every field 0."""
        if self._count >= self._grow_at:
            self._grow()
        slot = self._probe(key)
        assert self._slots[slot] == NO_RECORD, f"key {bytes(key).hex()} is already in the table"
        record = self._allocate()
        whole = int.from_bytes(key, "little")
        self._lo[record] = whole & _WORD_MASK
        self._hi[record] = whole >> 64
        self._state[record] = _LIVE
        self._slots[slot] = record
        self._count += 1
        self._mutations += 1
        assert self._count <= self._grow_at
        return record

    def detach(self, key: bytes) -> int:
        """Take ``key`` out of the hash but keep its record, fields and `key_of`,
        until `release`; returns the record, or `NO_RECORD` if ``key`` was absent."""
        slot = self._probe(key)
        record = self._slots[slot]
        if record == NO_RECORD:
            return NO_RECORD
        assert self._state[record] == _LIVE, record
        self._vacate(slot)
        self._state[record] = _DETACHED
        self._count -= 1
        self._mutations += 1
        return record

    def release(self, record: int) -> None:
        """Free a detached record; its id may be handed out again by `insert`."""
        assert self._state[record] == _DETACHED, f"record {record} is not detached"
        self._state[record] = _FREE
        self._lo[record] = self._free_head
        self._free_head = record

    def remove(self, key: bytes) -> int:
        """Delete ``key`` and free its record at once; returns the (now free)
        record id, or `NO_RECORD` if ``key`` was absent."""
        record = self.detach(key)
        if record != NO_RECORD:
            self.release(record)
        return record

    def is_live(self, record: int) -> bool:
        """Is ``record`` live (its key in the hash), rather than detached or free?"""
        return self._state[record] == _LIVE

    def key_of(self, record: int) -> bytes:
        """The key of a live or detached record."""
        assert self._state[record] != _FREE, f"record {record} is free"
        return ((self._hi[record] << 64) | self._lo[record]).to_bytes(KEY_BYTES, "little")

    def __len__(self) -> int:
        """Live keys (detached records are not counted)."""
        return self._count

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        """(key, record) of every live key, in no particular order. The table
        must not change until the iteration ends (asserted)."""
        mutations = self._mutations
        for record in self._slots:
            if record != NO_RECORD:
                yield self.key_of(record), record
                assert self._mutations == mutations, "the table changed during an iteration"

    # -- fields ----------------------------------------------------------------

    def get(self, record: int, field: int) -> int:
        """Field ``field`` of a live or detached record."""
        assert 0 <= field < len(self._fields), (field, len(self._fields))
        assert self._state[record] != _FREE, f"record {record} is free"
        return self._fields[field][record]

    def set(self, record: int, field: int, value: int) -> None:
        """Set field ``field`` of a live or detached record to ``value`` in
        [0, 2**width) of its field; anything else raises ValueError and changes nothing."""
        assert 0 <= field < len(self._fields), (field, len(self._fields))
        assert self._state[record] != _FREE, f"record {record} is free"
        self._fields[field][record] = value

    # -- accounting ------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes the table's arrays hold, headers and unused capacity included."""
        columns = (self._lo, self._hi, self._state, *self._fields)
        return sys.getsizeof(self) + sys.getsizeof(self._slots) + sum(column.nbytes for column in columns)

    def verify(self) -> None:
        """Assert every invariant of the layout. Walks every slot and cluster: for tests."""
        slots, mask = self._slots, self._mask
        assert len(slots) == mask + 1 and len(slots) & mask == 0, len(slots)
        assert len(self._lo) == len(self._hi) == len(self._state) <= RECORDS_MAX
        assert all(len(column) == len(self._state) for column in self._fields)
        assert self._records <= len(self._state)
        states = bytes(self._state[: self._records])
        live = 0
        for slot, record in enumerate(slots):
            if record == NO_RECORD:
                continue
            live += 1
            assert self._state[record] == _LIVE, (slot, record)
            # No empty slot between a key's home and its slot, or probes would stop short.
            home = _home(self._lo[record], self._hi[record], self._shift)
            assert all(slots[i & mask] != NO_RECORD for i in range(home, home + ((slot - home) & mask)))
            key = self.key_of(record)
            assert self.find(key) == record, key.hex()
        assert live == self._count == states.count(_LIVE) <= self._grow_at
        free, record = 0, self._free_head
        while record != _FREE_END:
            assert self._state[record] == _FREE, record
            free, record = free + 1, self._lo[record]
        assert free == states.count(_FREE)

    # -- internals -------------------------------------------------------------

    def _probe(self, key: bytes) -> int:
        """The slot holding ``key``, or the empty slot where it would go;
        ValueError unless ``key`` is `KEY_BYTES` long (an input: checked, not asserted).

        Ends because the load factor keeps at least one slot empty. Compares two
        ints per occupied slot: measured faster than slicing the key out of a
        bytearray or a memoryview and comparing bytes (0.75 against 0.85 and
        0.88 us per find in a table of 100 000 keys).
        """
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
        whole = int.from_bytes(key, "little")
        lo, hi = whole & _WORD_MASK, whole >> 64
        slots, los, his, mask = self._slots, self._lo, self._hi, self._mask
        slot = _home(lo, hi, self._shift)
        while True:
            record = slots[slot]
            if record == NO_RECORD or (los[record] == lo and his[record] == hi):
                return slot
            slot = (slot + 1) & mask

    def _vacate(self, hole: int) -> None:
        """Empty slot ``hole`` and close the gap (backward-shift deletion).

        Walks the rest of the cluster; a key moves back into the hole when the
        hole lies on its probe path (between its home slot and where it is now),
        which leaves a new hole where it was.
        """
        slots, los, his, mask, shift = self._slots, self._lo, self._hi, self._mask, self._shift
        slot = hole
        while True:
            slot = (slot + 1) & mask
            record = slots[slot]
            if record == NO_RECORD:
                break
            home = _home(los[record], his[record], shift)
            if (slot - home) & mask >= (slot - hole) & mask:
                slots[hole] = record
                hole = slot
        slots[hole] = NO_RECORD

    def _grow(self) -> None:
        """Double the slots and rehash every live key; record ids are kept."""
        old = self._slots
        size = 2 * len(old)
        slots = array.array("i", [NO_RECORD]) * size
        los, his, mask, shift = self._lo, self._hi, size - 1, 64 - (size.bit_length() - 1)
        for record in old:
            if record == NO_RECORD:
                continue
            slot = _home(los[record], his[record], shift)
            while slots[slot] != NO_RECORD:
                slot = (slot + 1) & mask
            slots[slot] = record
        self._slots, self._mask, self._shift = slots, mask, shift
        self._grow_at = int(size * LOAD_FACTOR_MAX)

    def _allocate(self) -> int:
        """A free record with every field 0: the head of the free list, else a new one."""
        record = self._free_head
        if record != _FREE_END:
            assert self._state[record] == _FREE, record
            self._free_head = self._lo[record]
            for column in self._fields:
                column[record] = 0
            return record
        record = self._records
        assert record < RECORDS_MAX, "record ids exhausted"
        if record == len(self._state):
            capacity = 2 * record
            self._lo = _column("Q", capacity, self._lo)
            self._hi = _column("Q", capacity, self._hi)
            self._fields = [
                _column(typecode, capacity, column) for typecode, column in zip(self._types, self._fields, strict=True)
            ]
            self._state = _column("B", capacity, self._state)
        self._records = record + 1
        return record  # Fields of a record never used are 0 already (fresh pages).
