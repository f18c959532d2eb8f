"""The ring allocator and the /dev/shm sizing plan, on their own."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.config import MIB
from kvharbor.gateway.shm import PAGE_BYTES, Segment, ShmTooSmall, plan_ring
from kvharbor.hal.extents import Extents, round_up

# -- ring ----------------------------------------------------------------------


@settings(max_examples=300)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40 * PAGE_BYTES)), max_size=120))
def test_ring_extents_never_overlap_and_all_come_back(ops: list[tuple[bool, int]]) -> None:
    ring = Extents(64 * PAGE_BYTES)
    held: dict[int, int] = {}
    for allocate, size in ops:
        if allocate or not held:
            offset = ring.allocate(size)
            if offset is None:
                continue  # Full, or too fragmented for this size.
            end = offset + round_up(size)
            assert offset % PAGE_BYTES == 0 and end <= ring.size
            assert all(end <= o or offset >= o + n for o, n in held.items()), "overlap"
            held[offset] = round_up(size)
        else:
            offset = next(iter(held))
            assert ring.free(offset, held[offset]) == held.pop(offset)
        ring.check()
        assert ring.free_bytes == ring.size - sum(held.values())
    for offset, length in held.items():
        ring.free(offset, length)
    ring.check()
    assert ring.free_bytes == ring.size
    assert ring.allocate(ring.size) == 0, "everything coalesced back into one extent"


def test_ring_refuses_more_than_it_has_without_waiting() -> None:
    ring = Extents(4 * PAGE_BYTES)
    assert ring.allocate(5 * PAGE_BYTES, deadline=time.monotonic() + 3600) is None


def test_ring_waiter_gets_room_when_it_is_freed() -> None:
    ring = Extents(4 * PAGE_BYTES)
    first = ring.allocate(4 * PAGE_BYTES)
    assert first == 0
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(ring.allocate(PAGE_BYTES, time.monotonic() + 30)))
    waiter.start()
    ring.free(first, 4 * PAGE_BYTES)  # Whether the waiter is already waiting or not, it gets the room.
    waiter.join(30)
    assert got == [0]


def test_ring_deadline_passes_and_none_is_returned() -> None:
    ring = Extents(PAGE_BYTES)
    assert ring.allocate(PAGE_BYTES) == 0
    assert ring.allocate(PAGE_BYTES, deadline=time.monotonic() + 0.01) is None


def test_freeing_twice_is_caught() -> None:
    ring = Extents(4 * PAGE_BYTES)
    offset = ring.allocate(PAGE_BYTES)
    assert offset is not None
    ring.free(offset, PAGE_BYTES)
    with pytest.raises(AssertionError, match="freed twice"):
        ring.free(offset, PAGE_BYTES)


# -- /dev/shm sizing -------------------------------------------------------------


def test_plan_fits_as_asked() -> None:
    plan = plan_ring(1024 * MIB, 64 * MIB, free_bytes=4096 * MIB, total_bytes=8192 * MIB, reserve_bytes=64 * MIB)
    assert plan.granted_bytes == 1024 * MIB and not plan.shrunk


def test_plan_shrinks_to_fit_and_says_how_to_enlarge() -> None:
    plan = plan_ring(1024 * MIB, 64 * MIB, free_bytes=300 * MIB + 123, total_bytes=512 * MIB, reserve_bytes=64 * MIB)
    assert plan.shrunk and plan.granted_bytes == 236 * MIB
    warning = plan.warning(Path("/dev/shm"))
    expected = ("1024 MiB", "300 MiB free of 512 MiB", "64 MiB kept free", "using 236 MiB", "--shm-size=", "--ipc=host")
    for words in expected:
        assert words in warning, words


def test_plan_refuses_below_the_minimum() -> None:
    with pytest.raises(ShmTooSmall) as caught:
        plan_ring(1024 * MIB, 64 * MIB, free_bytes=100 * MIB, total_bytes=100 * MIB, reserve_bytes=64 * MIB)
    message = str(caught.value)
    for words in ("at least 64 MiB (gateway.ring_mb_min)", "100 MiB free of 100 MiB", "--shm-size=", "--ipc=host"):
        assert words in message, words


def test_plan_at_exactly_the_minimum_starts() -> None:
    plan = plan_ring(1024 * MIB, 64 * MIB, free_bytes=64 * MIB, total_bytes=64 * MIB)
    assert plan.granted_bytes == 64 * MIB


def _shm_used_bytes() -> int:
    vfs = os.statvfs("/dev/shm")
    return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize


def test_a_closed_segment_gives_its_pages_back_while_a_view_of_it_lives() -> None:
    """A stopped gateway's objects may keep a view until the garbage collector frees
    them: the owner's close still returns the segment's memory to /dev/shm."""
    size = 64 * MIB
    segment = Segment.create(Path(f"/dev/shm/kvh-test-units-{os.getpid()}"), size)
    kept = segment.view[:PAGE_BYTES]
    before = _shm_used_bytes()
    segment.close()
    freed = before - _shm_used_bytes()
    assert freed >= size // 2, f"{freed} bytes freed of {size}"  # Others use /dev/shm at the same time.
    assert bytes(kept[:8]) == bytes(8)  # The pages read as zeros now, never anyone else's.
    kept.release()
