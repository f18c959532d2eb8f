"""Slots smaller than a page for small objects, in slabs taken from a region's `Extents`.

Why: the shared RAM tier keeps each object in whole pages, and an object of the cache
format is its header (`kvharbor.cache.format.HEADER_BYTES`, a page) and its payload. A
value of 64 bytes is an object of 4,160 bytes, which whole pages round to 8,192: such a
tier holds half the values its capacity says. Small values are common (SGLang's pages can
be a few tokens), so the room lost to rounding must not depend on the value's size.

A slab is `SLAB_BYTES` of the region, cut into equal slots of one size: the object's size
rounded up to `SLOT_ALIGN_BYTES` (4,160 bytes for that value). An object costs its slot's
share of its slab (`slot_share`: the slab divided among its slots, its tail included), and a
slab whose last slot is freed goes back to the region.

Why slabs and not the alternatives:

- A compact header for small objects would change the format everywhere it is read (the
  header's size is a constant of files, block stores, card objects, the piece checksums and
  every payload offset the gateway names): a larger change than the room it saves.
- Extents of 64-byte granularity would grow the first-fit free list to a hole per freed
  object, and each allocation scans it.
- Slots of one size per slab are allocated and freed in O(1) from a stack per slab, and
  slabs of one size drain together as the tier evicts its least recently used values.

Only where it saves (`slot_bytes`): an object whose size is a page multiple (most KV
values: their payloads are) or that whole pages round up by little stays in its own pages,
page-aligned (O_DIRECT, DMA) and written in place by clients (the tier's `InPlaceWrites`).
A slot is aligned to `SLOT_ALIGN_BYTES` only, and shares its pages with other objects, so
it is never lent to a client for writing (a writer's page protection would open its
neighbours too): it is written by the gateway's put.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field

from kvharbor.hal.extents import Extents, round_up

SLOT_ALIGN_BYTES = 64
"""A slot's size is a multiple of this (a cache line), so every slot, and the payload a page
of header into it, starts on a cache line: copies and DMA run at full speed."""

SLAB_BYTES = 256 * 1024
"""One slab (64 pages): large enough that its tail (what no whole slot fills) is small beside
it, small enough that a slab of a size no longer written soon empties and goes back."""

SLAB_SLOTS_MIN = 8
"""A slab holds at least this many slots: larger objects stay in pages (slots above
``SLAB_BYTES // SLAB_SLOTS_MIN``, 32 KiB, would leave too much of a slab in its tail)."""

SLAB_SAVING_DIVISOR = 8
"""An object goes to a slab only if its slot's share is at least 1/8 smaller than its whole
pages: below that saving, page alignment and in-place writes are worth more."""


def slot_share(slot: int) -> int:
    """Bytes of its slab one slot of ``slot`` bytes accounts for: the slab divided among its
    slots, rounded up, so that a full slab's objects account for all of it."""
    assert 0 < slot <= SLAB_BYTES // SLAB_SLOTS_MIN and slot % SLOT_ALIGN_BYTES == 0, slot
    return -(-SLAB_BYTES // (SLAB_BYTES // slot))


def slot_bytes(nbytes: int) -> int | None:
    """The slot an object of ``nbytes`` takes in a slab, or None where it stays in whole pages
    (see the module docstring: a slab must save `SLAB_SAVING_DIVISOR`'s share of its pages)."""
    if nbytes < 0:
        raise ValueError(f"an object of {nbytes} bytes has no place")
    slot = max(1, -(-nbytes // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES  # An empty value takes room too.
    if slot > SLAB_BYTES // SLAB_SLOTS_MIN:
        return None
    if slot_share(slot) * SLAB_SAVING_DIVISOR > round_up(nbytes) * (SLAB_SAVING_DIVISOR - 1):
        return None
    return slot


@dataclass(slots=True)
class _Slab:
    start: int
    """Its offset in the region (page-aligned: an extent)."""
    slot: int
    free: list[int]
    """Indices of its free slots, a stack: the last freed is the next taken."""
    taken: bytearray = field(init=False)
    """1 per slot in use: a slot freed twice or never taken is caught."""

    def __post_init__(self) -> None:
        self.taken = bytearray(len(self.free))

    @property
    def slots(self) -> int:
        return len(self.taken)


class Slabs:
    """Slots of sizes `slot_bytes` gives, in slabs of `SLAB_BYTES` taken from ``extents``.

    Per slot size, the slabs with a free slot are kept in the order they got one (a dict
    used as an ordered set): an allocation takes from the newest, a free of a full slab's
    slot makes it the newest, a slab emptied goes back to ``extents``. Thread-safe; the lock
    is taken before the extents' own, never after.
    """

    def __init__(self, extents: Extents) -> None:
        self._extents = extents
        self._starts: list[int] = []
        """Every slab's start, sorted: the slab of a slot is found by bisection."""
        self._slabs: dict[int, _Slab] = {}
        self._with_room: dict[int, dict[int, _Slab]] = {}
        """Slot size -> start -> slab, of the slabs with a free slot."""
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Bytes of the region the slabs hold now, their free slots and tails included."""
        return len(self._slabs) * SLAB_BYTES

    def allocate(self, slot: int) -> int | None:
        """The region offset of a free slot of ``slot`` bytes (a size `slot_bytes` gives), or
        None when no slab of that size has one and the region has no room for another."""
        with self._lock:
            room = self._with_room.setdefault(slot, {})
            if room:
                slab = next(reversed(room.values()))
            else:
                start = self._extents.allocate(SLAB_BYTES)
                if start is None:
                    return None
                slab = _Slab(start, slot, list(range(SLAB_BYTES // slot - 1, -1, -1)))
                bisect.insort(self._starts, start)
                self._slabs[start] = slab
                room[start] = slab
            index = slab.free.pop()
            slab.taken[index] = 1
            if not slab.free:
                del room[slab.start]
            return slab.start + index * slot

    def free(self, offset: int, slot: int) -> bool:
        """Give back the slot of ``slot`` bytes `allocate` returned at ``offset``; False, and
        nothing done, where ``offset`` lies in no slab (an extent of the region's own). Raises
        ValueError for an offset in a slab that is not a slot of that size in use (freed
        twice, or never taken)."""
        with self._lock:
            at = bisect.bisect_right(self._starts, offset) - 1
            if at < 0 or offset >= self._starts[at] + SLAB_BYTES:
                return False
            slab = self._slabs[self._starts[at]]
            index, within = divmod(offset - slab.start, slot)
            if slab.slot != slot or within or index >= slab.slots or not slab.taken[index]:
                raise ValueError(f"no slot of {slot} bytes is in use at offset {offset}")
            slab.taken[index] = 0
            slab.free.append(index)
            room = self._with_room[slot]
            if len(slab.free) == slab.slots:  # Empty: the region takes it back.
                room.pop(slab.start, None)
                del self._slabs[slab.start]
                del self._starts[at]
                self._extents.free(slab.start, SLAB_BYTES)
            elif len(slab.free) == 1:  # Was full.
                room[slab.start] = slab
            return True

    def check(self) -> None:
        """Full consistency check, O(slots): starts sorted and apart, each slab's free stack
        the complement of its taken slots, exactly the slabs with a free slot listed with
        room, no slab empty (it would have gone back)."""
        with self._lock:
            assert self._starts == sorted(self._slabs), "slab starts out of order"
            for before, after in itertools.pairwise(self._starts):
                assert after - before >= SLAB_BYTES, (before, after)
            listed = {start for room in self._with_room.values() for start in room}
            for start, slab in self._slabs.items():
                assert sorted(slab.free) == [i for i in range(slab.slots) if not slab.taken[i]], start
                assert len(slab.free) < slab.slots, f"empty slab at {start} kept"
                assert (start in listed) == bool(slab.free), start
                assert start not in listed or start in self._with_room[slab.slot], start
