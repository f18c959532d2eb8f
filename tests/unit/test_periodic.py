"""`Periodic`: the one lifecycle of the gateway's and the dashboard's background loops."""

from __future__ import annotations

import logging
import threading

import pytest

from kvharbor.periodic import Periodic


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_tick_that_raises_is_logged_and_the_loop_goes_on() -> None:
    errors = Errors()
    logger = logging.getLogger("kvharbor.periodic")
    logger.addHandler(errors)
    ticks = 0
    third = threading.Event()

    def tick() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 3:
            third.set()
        if ticks == 1:
            raise RuntimeError("one bad round")

    periodic = Periodic("kvharbor-test-loop", 0.001, tick).start()
    try:
        assert third.wait(30), "the loop ended after its first tick raised"
    finally:
        periodic.stop()
        logger.removeHandler(errors)
    assert errors.messages == ["kvharbor: kvharbor-test-loop: unexpected error; it runs again in 0.001 s"]
    assert periodic.stopping and not periodic._thread.is_alive()


def test_stop_is_safe_before_start_and_twice() -> None:
    periodic = Periodic("kvharbor-test-idle", 60.0, lambda: None)
    periodic.stop()
    periodic.stop()
    assert periodic.stopping


def test_stop_waits_for_the_tick_in_progress() -> None:
    inside, release, finished = threading.Event(), threading.Event(), threading.Event()

    def tick() -> None:
        inside.set()
        release.wait(30)
        finished.set()

    periodic = Periodic("kvharbor-test-slow", 0.001, tick).start()
    assert inside.wait(30)
    stopper = threading.Thread(target=periodic.stop)
    stopper.start()
    assert not finished.is_set()
    release.set()
    stopper.join(30)
    assert finished.is_set() and not stopper.is_alive()


@pytest.mark.parametrize("interval_s", [0, -1.0, float("nan")])
def test_an_interval_that_is_not_positive_is_refused(interval_s: float) -> None:
    with pytest.raises(ValueError, match=r"kvharbor-test: the interval must be > 0 s"):
        Periodic("kvharbor-test", interval_s, lambda: None)
