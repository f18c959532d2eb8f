"""KeyTable against a dict model, its collisions and memory; MemoryIndex against the OrderedDict it replaced."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvharbor.cache.index import Entry, MemoryIndex, OverBudget
from kvharbor.hal.keytable import KEY_BYTES, NO_RECORD, KeyTable

FIELDS = "QQQ"
FIELD_MAX = 2**64 - 1

PER_KEY_BYTES_MAX = 64
"""KeyTable with 4 fields (QIII): key, fields, state byte, slots and growth slack."""
INDEX_PER_ENTRY_BYTES_MAX = 128
"""The gateway's budget per stored key beyond the values."""
MANY = 100_000

T = TypeVar("T")


_GOLDEN_INVERSE = pow(0x9E3779B97F4A7C15, -1, 2**64)


def colliding(product: int, n: int) -> bytes:
    """The ``n``-th key whose hash product (its two halves folded by XOR, times the
    table's multiplier, mod 2**64) is ``product``: such keys share a home slot, the
    top bits of ``product``, in every table size."""
    fold = product * _GOLDEN_INVERSE % 2**64
    hi = n + 1
    return (fold ^ hi).to_bytes(8, "little") + hi.to_bytes(8, "little")


LAST = 2**64 - 1
"""Home is the last slot of any table: its cluster wraps around to slot 0."""
FIRST = 0
SECOND = 2**63
"""Home is the middle slot of any table."""

# Random keys, plus clusters that collide in every table size (the same hash
# product), one of them wrapping around the end of the slots.
_rng = random.Random(7)
POOL = (
    [_rng.randbytes(KEY_BYTES) for _ in range(120)]
    + [colliding(LAST, n) for n in range(6)]
    + [colliding(FIRST, n) for n in range(6)]
    + [colliding(SECOND, n) for n in range(4)]
)


# -- against a dict model ------------------------------------------------------


class KeyTableMatchesDict(RuleBasedStateMachine):
    """Every answer of the table equals a dict's; `verify` holds after each step."""

    detached = Bundle("detached")

    def __init__(self) -> None:
        super().__init__()
        self.table = KeyTable(FIELDS)
        self.live: dict[bytes, int] = {}
        self.fields: dict[int, list[int]] = {}
        """Of every live and detached record."""
        self.detached_keys: dict[int, bytes] = {}

    keys = st.sampled_from(POOL)

    def _insert(self, key: bytes) -> None:
        record = self.table.insert(key)
        assert record not in self.fields, "a record still in use was handed out again"
        assert [self.table.get(record, f) for f in range(len(FIELDS))] == [0] * len(FIELDS)
        self.live[key] = record
        self.fields[record] = [0] * len(FIELDS)

    @rule(key=keys)
    def insert(self, key: bytes) -> None:
        if key in self.live:
            with pytest.raises(AssertionError, match="already in the table"):
                self.table.insert(key)
        else:
            self._insert(key)

    @rule(count=st.integers(1, 60))
    def fill(self, count: int) -> None:
        """Many inserts at once, so that runs grow the table past several doublings."""
        for key in [k for k in POOL if k not in self.live][:count]:
            self._insert(key)

    @rule(key=keys)
    def remove(self, key: bytes) -> None:
        record = self.live.pop(key, NO_RECORD)
        assert self.table.remove(key) == record
        if record != NO_RECORD:
            del self.fields[record]

    @rule(target=detached, key=keys)
    def detach(self, key: bytes) -> int:
        record = self.live.pop(key, NO_RECORD)
        assert self.table.detach(key) == record
        if record != NO_RECORD:
            self.detached_keys[record] = key
        return record

    @rule(record=consumes(detached))
    def release(self, record: int) -> None:
        if record == NO_RECORD:
            return
        assert self.table.key_of(record) == self.detached_keys.pop(record)
        assert [self.table.get(record, f) for f in range(len(FIELDS))] == self.fields.pop(record)
        self.table.release(record)

    @rule(key=keys)
    def find(self, key: bytes) -> None:
        assert self.table.find(key) == self.live.get(key, NO_RECORD)
        assert (key in self.table) == (key in self.live)

    @precondition(lambda self: bool(self.fields))
    @rule(data=st.data(), field=st.integers(0, len(FIELDS) - 1), value=st.integers(0, FIELD_MAX))
    def set(self, data: st.DataObject, field: int, value: int) -> None:
        record = data.draw(st.sampled_from(sorted(self.fields)))
        self.table.set(record, field, value)
        self.fields[record][field] = value

    @invariant()
    def same_contents(self) -> None:
        self.table.verify()
        assert len(self.table) == len(self.live)
        assert dict(self.table) == self.live
        for record, want in self.fields.items():
            assert [self.table.get(record, f) for f in range(len(FIELDS))] == want
        for record, key in self.detached_keys.items():
            assert self.table.key_of(record) == key and self.table.find(key) != record


KeyTableMatchesDict.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestKeyTableMatchesDict = KeyTableMatchesDict.TestCase


# -- collisions and deletion ---------------------------------------------------


@given(
    keys=st.lists(st.sampled_from(POOL[-16:]), min_size=1, max_size=16, unique=True).flatmap(
        lambda ks: st.tuples(st.just(ks), st.permutations(ks))
    )
)
def test_backward_shift_deletion_keeps_every_other_key_of_a_cluster_findable(
    keys: tuple[list[bytes], list[bytes]],
) -> None:
    inserted, removal_order = keys
    table = KeyTable("Q")
    records = {key: table.insert(key) for key in inserted}
    for n, gone in enumerate(removal_order):
        assert table.remove(gone) == records.pop(gone)
        assert table.find(gone) == NO_RECORD
        for key, record in records.items():
            assert table.find(key) == record, f"lost {key.hex()} after removing {n + 1} keys"
        table.verify()
    assert len(table) == 0


def test_a_cluster_wrapping_past_the_last_slot_closes_up_on_removal() -> None:
    table = KeyTable("Q")
    wrapping = [colliding(LAST, n) for n in range(3)]  # Last slot, then slots 0 and 1.
    at_zero = colliding(FIRST, 0)  # Home 0 is taken: pushed on to slot 2.
    for key in [*wrapping, at_zero]:
        table.insert(key)
    table.remove(wrapping[0])
    assert [table.find(k) != NO_RECORD for k in [*wrapping, at_zero]] == [False, True, True, True]
    table.verify()


def test_churn_reuses_records_and_keeps_the_table_from_growing() -> None:
    rng = random.Random(1)
    table = KeyTable("QQ")
    live = [rng.randbytes(KEY_BYTES) for _ in range(500)]
    for key in live:
        table.insert(key)
    settled = table.nbytes()
    for _ in range(20_000):
        gone = live.pop(rng.randrange(len(live)))
        table.remove(gone)
        live.append(rng.randbytes(KEY_BYTES))
        table.insert(live[-1])
    assert table.nbytes() == settled
    assert sorted(k for k, _ in table) == sorted(live)
    table.verify()


# -- detached records ----------------------------------------------------------


def test_a_detached_record_keeps_key_and_fields_until_released_while_the_key_is_reused() -> None:
    table = KeyTable("QQ")
    key = colliding(FIRST, 1)
    old = table.insert(key)
    table.set(old, 1, 42)
    assert table.detach(key) == old
    assert table.find(key) == NO_RECORD and key not in table and len(table) == 0
    new = table.insert(key)  # A replacement while a reader still holds the old record.
    assert new != old and table.get(new, 1) == 0
    assert (table.key_of(old), table.get(old, 1)) == (key, 42) and type(table.key_of(old)) is bytes
    assert list(table) == [(key, new)]
    table.release(old)
    with pytest.raises(AssertionError, match="is free"):
        table.get(old, 1)
    assert table.insert(colliding(FIRST, 2)) == old  # Freed records are reused.


def test_only_a_detached_record_can_be_released() -> None:
    table = KeyTable("Q")
    record = table.insert(colliding(FIRST, 1))
    with pytest.raises(AssertionError, match="not detached"):
        table.release(record)
    table.remove(colliding(FIRST, 1))
    with pytest.raises(AssertionError, match="not detached"):
        table.release(record)


# -- contracts -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"", b"k" * 15, b"k" * 17, bytearray(32)])
def test_a_key_of_the_wrong_length_is_refused_by_name(bad: bytes) -> None:
    table = KeyTable("Q")
    message = f"a key is 16 bytes, got {len(bad)}"
    for operation in (table.find, table.insert, table.detach, table.remove, table.__contains__):
        with pytest.raises(ValueError, match=message):
            operation(bad)
    assert len(table) == 0


def test_fields_are_bounded_by_index_and_value() -> None:
    table = KeyTable("QQ")
    record = table.insert(POOL[0])
    table.set(record, 1, FIELD_MAX)
    assert table.get(record, 1) == FIELD_MAX
    for field in (-1, 2):
        with pytest.raises(AssertionError):
            table.get(record, field)
        with pytest.raises(AssertionError):
            table.set(record, field, 0)
    for value in (-1, FIELD_MAX + 1):
        with pytest.raises(ValueError):
            table.set(record, 0, value)
    assert [table.get(record, f) for f in range(2)] == [0, FIELD_MAX]


def test_changing_the_table_during_an_iteration_is_caught() -> None:
    table = KeyTable("")
    for key in POOL[:3]:
        table.insert(key)
    with pytest.raises(AssertionError, match="changed during an iteration"):
        for key, _ in table:
            table.remove(key)


# -- memory --------------------------------------------------------------------


ANON_BYTES_PER_KEY = """
import random, sys
from pathlib import Path
from kvharbor.cache.index import Entry, MemoryIndex
from kvharbor.hal.keytable import KeyTable

def anon() -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024

rng = random.Random(4)
count, what = int(sys.argv[1]), sys.argv[2]
keys = [rng.randbytes(16) for _ in range(count)]
before = anon()
if what == "table":
    table = KeyTable("QIII")
    for key in keys:
        table.insert(key)
else:  # A gateway's RAM tier: its index, and its device's table of places.
    index, places = MemoryIndex(), KeyTable("III")
    for key in keys:
        index.admit(Entry(key, 4096, 1), 1 << 50)
        places.insert(key)
print((anon() - before) / count)
"""


def anon_bytes_per_key(what: str, count: int = MANY) -> float:
    """Resident anonymous memory per key that filling ``what`` with ``count`` keys
    adds to a fresh process: what the kernel charges, allocator slack included."""
    run = subprocess.run(
        [sys.executable, "-c", ANON_BYTES_PER_KEY, str(count), what], capture_output=True, text=True, check=True
    )
    return float(run.stdout)


def test_a_key_with_four_fields_costs_at_most_64_bytes() -> None:
    per_key = anon_bytes_per_key("table")
    print(f"KeyTable QIII: {per_key:.1f} bytes per key for {MANY} keys")
    assert per_key <= PER_KEY_BYTES_MAX


def test_a_ram_tier_index_and_its_places_fit_the_gateways_budget_per_key() -> None:
    per_key = anon_bytes_per_key("tier")
    print(f"MemoryIndex and a table of places: {per_key:.1f} bytes per key for {MANY} keys")
    assert per_key <= INDEX_PER_ENTRY_BYTES_MAX


# -- MemoryIndex against the OrderedDict it replaced ---------------------------


class ReferenceIndex:
    """The OrderedDict MemoryIndex that KeyTable replaced, kept as the model."""

    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.used = 0

    def admit(self, entry: Entry, budget_bytes: int, pinned: frozenset[bytes]) -> list[Entry]:
        if entry.nbytes > budget_bytes:
            raise OverBudget("over")
        old = self.entries.get(entry.key)
        used = self.used - (old.nbytes if old is not None else 0)
        victims: list[Entry] = []
        for key, candidate in self.entries.items():
            if used + entry.nbytes <= budget_bytes:
                break
            if key in pinned or key == entry.key:
                continue
            victims.append(candidate)
            used -= candidate.nbytes
        if used + entry.nbytes > budget_bytes:
            raise OverBudget("pinned")
        for victim in victims:
            del self.entries[victim.key]
        self.entries.pop(entry.key, None)
        self.entries[entry.key] = entry
        self.used = used + entry.nbytes
        return victims

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)

    def remove(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.used -= entry.nbytes


INDEX_BUDGET = 1000
INDEX_KEYS = POOL[:12] + POOL[-8:]


class MemoryIndexMatchesReference(RuleBasedStateMachine):
    """Victims, LRU order, totals and refusals equal the OrderedDict index's, pins included."""

    def __init__(self) -> None:
        super().__init__()
        self.index = MemoryIndex()
        self.model = ReferenceIndex()

    keys = st.sampled_from(INDEX_KEYS)

    @rule(
        key=keys,
        nbytes=st.integers(1, INDEX_BUDGET + 50),
        parts=st.integers(1, 3),
        pinned=st.frozensets(keys, max_size=4),
    )
    def admit(self, key: bytes, nbytes: int, parts: int, pinned: frozenset[bytes]) -> None:
        entry = Entry(key, nbytes, parts)
        try:
            expected = self.model.admit(entry, INDEX_BUDGET, pinned)
        except OverBudget:
            with pytest.raises(OverBudget):
                self.index.admit(entry, INDEX_BUDGET, pinned)
            return
        assert self.index.admit(entry, INDEX_BUDGET, pinned) == expected

    @rule(ks=st.lists(keys, max_size=5))
    def touch(self, ks: list[bytes]) -> None:
        self.index.touch(ks)
        self.model.touch(ks)

    @rule(ks=st.lists(keys, max_size=5))
    def remove(self, ks: list[bytes]) -> None:
        self.index.remove(ks)
        self.model.remove(ks)

    @rule()
    def rebuild(self) -> None:
        survivors = list(self.model.entries.values())
        self.index.rebuild(survivors)
        assert self.index.lru(len(INDEX_KEYS)) == survivors

    @invariant()
    def same_state(self) -> None:
        assert self.index.lru(len(INDEX_KEYS)) == list(self.model.entries.values())
        assert (self.index.used_bytes(), self.index.count()) == (self.model.used, len(self.model.entries))
        assert self.index.contains(INDEX_KEYS) == [k in self.model.entries for k in INDEX_KEYS]
        assert [self.index.get(k) for k in INDEX_KEYS] == [self.model.entries.get(k) for k in INDEX_KEYS]
        self.index._table.verify()  # The layout under the index, not only its answers.


MemoryIndexMatchesReference.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestMemoryIndexMatchesReference = MemoryIndexMatchesReference.TestCase


def test_lru_stops_at_its_limit_and_rebuild_keeps_the_given_order() -> None:
    index = MemoryIndex()
    entries = [Entry(key, 10 + n, 1) for n, key in enumerate(POOL[:5])]
    index.rebuild(reversed(entries))
    assert index.lru(2) == [entries[4], entries[3]]
    assert index.lru(0) == []
    assert (index.used_bytes(), index.count()) == (sum(e.nbytes for e in entries), 5)


def test_rebuild_with_a_repeated_key_keeps_its_first_place_and_last_entry() -> None:
    index = MemoryIndex()
    a, b = POOL[0], POOL[1]
    index.rebuild([Entry(a, 10, 1), Entry(b, 20, 1), Entry(a, 30, 2)])  # As the OrderedDict's assignment did.
    assert index.lru(5) == [Entry(a, 30, 2), Entry(b, 20, 1)]
    assert (index.used_bytes(), index.count()) == (50, 2)
