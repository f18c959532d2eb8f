"""The circuit breaker: opens above the failure ratio, cools down, tries once, closes or reopens.

Time is an injected fake clock that the test moves by hand: the breaker's
behaviour over time is tested without waiting for it.
"""

from __future__ import annotations

import pytest

from kvharbor.cache.breaker import BreakerSettings, BreakerState, CircuitBreaker

# Opens when more than 2 of the last 10 operations failed.
SETTINGS = BreakerSettings(
    failure_ratio=0.2, window=10, cooldown_s=30.0, probe_backoff_factor=2.0, probe_interval_max_s=100.0
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker(SETTINGS, clock=clock)


def record_all(breaker: CircuitBreaker, outcomes: str) -> list[BreakerState]:
    """Record outcomes written as a string: ``.`` success, ``x`` failure."""
    return [breaker.record(c == ".") for c in outcomes]


def allowed(breaker: CircuitBreaker) -> bool:
    """Whether an operation may start now; the attempt is left open, as a running one is."""
    return breaker.attempt().allowed


def open_breaker(breaker: CircuitBreaker) -> None:
    record_all(breaker, "xxxxxxxxxx")
    assert breaker.state is BreakerState.OPEN


def test_opens_above_the_ratio_once_the_window_is_full(breaker: CircuitBreaker) -> None:
    # Three failures straight away are above 20 %, but nine operations are too
    # few to judge: the breaker waits for a full window.
    states = record_all(breaker, "xxx......" + ".")
    assert states[:9] == [BreakerState.CLOSED] * 9
    assert states[9] is BreakerState.OPEN
    assert allowed(breaker) is False
    assert breaker.opened_total == 1


def test_stays_closed_at_or_below_the_ratio(breaker: CircuitBreaker) -> None:
    # Exactly 2 of every 10 fail, forever: at the ratio is not above it.
    states = record_all(breaker, "x....x...." * 20)
    assert set(states) == {BreakerState.CLOSED}
    assert allowed(breaker) is True


def test_old_failures_leave_the_window(breaker: CircuitBreaker) -> None:
    # Six failures in all, but never more than two within any ten in a row.
    states = record_all(breaker, "xx" + "." * 8 + "xx" + "." * 8 + "xx")
    assert set(states) == {BreakerState.CLOSED}
    assert breaker.record(False) is BreakerState.OPEN  # Now 3 of the last 10.


def test_cooldown_then_half_open_allows_exactly_one_trial(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.now += SETTINGS.cooldown_s - 0.001
    assert breaker.state is BreakerState.OPEN
    assert allowed(breaker) is False
    clock.now += 0.001
    assert breaker.state is BreakerState.HALF_OPEN
    assert allowed(breaker) is True
    assert [allowed(breaker) for _ in range(5)] == [False] * 5  # One trial at a time.


def test_a_successful_trial_closes_and_starts_a_fresh_window(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.now += SETTINGS.cooldown_s
    assert allowed(breaker)
    assert breaker.record(True) is BreakerState.CLOSED
    assert all(allowed(breaker) for _ in range(5))
    # The failures from before are forgotten: three new ones wait for a full window again.
    assert set(record_all(breaker, "xxx")) == {BreakerState.CLOSED}


def wait_until_half_open(breaker: CircuitBreaker, clock: FakeClock, wait_s: float) -> None:
    """Move the clock ``wait_s`` on, checking that the breaker opens for exactly that long."""
    clock.now += wait_s - 0.001
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.001
    assert breaker.state is BreakerState.HALF_OPEN


def test_failed_trials_back_off_up_to_the_longest_wait_and_success_resets(
    breaker: CircuitBreaker, clock: FakeClock
) -> None:
    open_breaker(breaker)
    for wait_s in (30.0, 60.0, 100.0, 100.0):  # cooldown_s, doubled, then capped at probe_interval_max_s.
        wait_until_half_open(breaker, clock, wait_s)
        assert allowed(breaker)
        assert breaker.record(False) is BreakerState.OPEN  # The wait restarts at the failed trial.
    assert breaker.opened_total == 5
    wait_until_half_open(breaker, clock, 100.0)
    assert breaker.record(True) is BreakerState.CLOSED
    open_breaker(breaker)
    wait_until_half_open(breaker, clock, SETTINGS.cooldown_s)


def test_a_device_that_says_it_is_gone_trips_the_breaker_at_once(breaker: CircuitBreaker, clock: FakeClock) -> None:
    assert breaker.trip() is BreakerState.OPEN
    assert not allowed(breaker)
    wait_until_half_open(breaker, clock, SETTINGS.cooldown_s)
    assert allowed(breaker)
    assert breaker.trip() is BreakerState.OPEN, "a trial that finds it still gone"
    wait_until_half_open(breaker, clock, 2 * SETTINGS.cooldown_s)


@pytest.mark.parametrize(
    "changes",
    [
        {"failure_ratio": 0},
        {"window": 0},
        {"cooldown_s": 0},
        {"probe_backoff_factor": 0.5},
        {"probe_interval_max_s": 0},
    ],
)
def test_impossible_settings_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="out of range"):
        BreakerSettings(**changes)  # type: ignore[arg-type]


def test_outcomes_that_straggle_in_while_open_change_nothing(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    assert breaker.record(True) is BreakerState.OPEN
    clock.now += SETTINGS.cooldown_s
    assert breaker.state is BreakerState.HALF_OPEN


def test_a_trial_that_ends_without_an_outcome_is_handed_back(breaker: CircuitBreaker, clock: FakeClock) -> None:
    # An allowed operation that never reached storage (e.g. a value over the
    # tier budget) reports no outcome; leaving its attempt must hand the trial
    # back, or the breaker would stay half-open with its one trial taken,
    # skipping the tier for good.
    open_breaker(breaker)
    clock.now += SETTINGS.cooldown_s
    with breaker.attempt() as trial:
        assert trial.allowed and trial.trial
        assert allowed(breaker) is False, "one trial at a time"
    assert breaker.state is BreakerState.HALF_OPEN
    assert allowed(breaker) is True


def test_a_trial_left_by_an_exception_is_handed_back(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.now += SETTINGS.cooldown_s
    with pytest.raises(RuntimeError), breaker.attempt():
        raise RuntimeError("a bug between allow and outcome")
    assert allowed(breaker) is True


def test_a_reported_trial_is_not_undone_by_leaving_its_attempt(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.now += SETTINGS.cooldown_s
    with breaker.attempt():
        breaker.record(False)
    assert breaker.state is BreakerState.OPEN, "the failure stands"
    clock.now += breaker.wait_s
    assert breaker.state is BreakerState.HALF_OPEN
    trial = breaker.attempt()
    assert trial.allowed
    other = breaker.attempt()
    assert not other.allowed
    other.end()
    assert allowed(breaker) is False, "an attempt that held no trial hands none back"
    trial.end()
    assert allowed(breaker) is True


def test_a_stale_attempt_does_not_hand_back_a_later_trial(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.now += SETTINGS.cooldown_s
    stale = breaker.attempt()
    breaker.record(False)  # The trial failed (reported by whoever ran it) ...
    clock.now += breaker.wait_s
    current = breaker.attempt()  # ... and after the next cooldown another trial runs.
    assert current.allowed
    stale.end()
    assert allowed(breaker) is False, "the running trial is still the only one"
    current.end()


def test_attempts_while_closed_or_open(breaker: CircuitBreaker) -> None:
    with breaker.attempt() as attempt:
        assert attempt.allowed and attempt.trial == 0
    open_breaker(breaker)
    with breaker.attempt() as attempt:
        assert not attempt.allowed
