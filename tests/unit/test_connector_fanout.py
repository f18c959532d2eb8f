"""`Fanout`: every item once, several at once, errors raised only after every run ended."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvharbor.connector.fanout import Fanout

WAIT_S = 10.0
"""Longest wait for another run: far beyond any scheduling delay, short of the test's timeout."""


def test_every_item_runs_once_on_as_many_threads_as_asked() -> None:
    fanout = Fanout(3, "test-fanout")
    seen: list[int] = []
    threads: set[int] = set()
    lock = threading.Lock()
    # Each of the three runs waits at the barrier for the other two: one thread alone could not pass it.
    barrier = threading.Barrier(3, timeout=WAIT_S)

    def work(item: int) -> None:
        if item in (0, 4, 8):  # The first item of each run of 12 items over 3 threads.
            barrier.wait()
        with lock:
            seen.append(item)
            threads.add(threading.get_ident())

    fanout.run(work, list(range(12)))
    fanout.close()
    assert sorted(seen) == list(range(12))
    assert len(threads) == 3 and threading.get_ident() in threads  # The caller takes a run itself.


def test_each_thread_takes_a_contiguous_run_in_order() -> None:
    fanout = Fanout(2, "test-fanout")
    order: dict[int, list[int]] = {}
    lock = threading.Lock()

    def work(item: int) -> None:
        with lock:
            order.setdefault(threading.get_ident(), []).append(item)

    fanout.run(work, [10, 11, 12, 13, 14])
    fanout.close()
    assert sorted(order.values()) == [[10, 11], [12, 13, 14]]


def thread_recorder(where: list[int]) -> Callable[[int], None]:
    """An item's work that appends the thread it ran in to ``where``."""
    return lambda item: where.append(threading.get_ident())


def test_one_thread_or_one_item_runs_in_the_calling_thread() -> None:
    for threads, items in ((1, [1, 2, 3]), (4, [7])):
        fanout = Fanout(threads, "test-fanout")
        where: list[int] = []
        fanout.run(thread_recorder(where), items)
        assert where == [threading.get_ident()] * len(items)
        assert fanout._pool is None  # No thread was started for it.


def test_an_error_is_raised_once_every_run_has_ended() -> None:
    fanout = Fanout(2, "test-fanout")
    released = threading.Event()
    finished: list[int] = []

    def work(item: int) -> None:
        if item == 0:
            released.set()
            raise RuntimeError("copy failed")
        assert released.wait(WAIT_S)
        finished.append(item)

    with pytest.raises(RuntimeError, match="copy failed"):
        fanout.run(work, [0, 1, 2, 3])
    # The other run (items 2, 3) had ended when run() raised: nothing of the batch runs on.
    assert finished == [2, 3]

    # An error in another thread's run comes out too, and the fanout serves on.
    def last_fails(item: int) -> None:
        if item == 3:
            raise ValueError("bad page")

    with pytest.raises(ValueError, match="bad page"):
        fanout.run(last_fails, [0, 1, 2, 3])
    done: list[int] = []
    fanout.run(done.append, [5, 6])
    assert sorted(done) == [5, 6]
    fanout.close()
    fanout.run(done.append, [7, 8])  # After close, a run starts new threads.
    assert sorted(done) == [5, 6, 7, 8]
    fanout.close()


def test_no_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        Fanout(0, "test-fanout")
