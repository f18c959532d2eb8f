"""Log conventions: every kvharbor line starts with ``kvharbor:``; a repeated condition is said once and counted.

A degraded cache must say so clearly but must not flood the engine's log at
request rate: `OnceLog` says a condition when it starts, counts each time it
happens again while it lasts, and says that count when the condition clears
and, for a condition that never clears, at most once every
`REPEAT_SUMMARY_INTERVAL_S`. So a user reading the log sees every condition,
how often it happened, and at most one line per condition per interval.

The level tells a fault from an ordinary event: a miss is never a WARNING
(it is at most DEBUG); a WARNING or ERROR names the tier, the device or the
peer and the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "kvharbor: "

REPEAT_SUMMARY_INTERVAL_S = 600.0
"""The shortest time between two lines of one condition that keeps recurring; the later line
carries the count of the times it happened since the earlier one."""


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def attach_to_engine_log(level: int = logging.INFO) -> None:
    """Make ``kvharbor.*`` lines appear in a host process (an engine) that configured
    logging only for its own loggers. Does nothing if the root logger or
    ``kvharbor`` already has a handler."""
    root = logging.getLogger("kvharbor")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = _UntilRootHandles()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)


class _UntilRootHandles(logging.StreamHandler):
    """Writes a line only while the root logger has no handler: where the host configures
    logging later (a library calling ``logging.basicConfig``, as one in a hybrid model's
    start does), the line propagates there, and is not written twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


@dataclass(slots=True)
class _Active:
    """A condition that has been said and has not cleared."""

    message: str
    """What it said last (a repeat's message may name a newer error)."""
    said_at_s: float
    repeats: int = 0
    """Times it happened again since it was last said."""


class OnceLog:
    """Says each named condition once, counts its repeats, and says the count when it
    clears (`clear`) or, while it lasts, at most once every ``summary_interval_s``.

    Callers name conditions from a small, bounded set (a tier, a status code, a
    peer's uid), so the table of active conditions stays small.
    """

    def __init__(
        self,
        logger: logging.Logger,
        summary_interval_s: float = REPEAT_SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if summary_interval_s <= 0:
            raise ValueError(f"summary_interval_s must be positive, got {summary_interval_s}")
        self._logger = logger
        self._summary_interval_s = summary_interval_s
        self._clock = clock
        self._active: dict[str, _Active] = {}
        self._lock = threading.Lock()

    def say(self, condition: str, message: str, level: int = logging.WARNING) -> bool:
        """Log ``message`` if ``condition`` is not active yet, else count it (and log the
        count if the last line of it is older than the summary interval); True if logged."""
        now = self._clock()
        with self._lock:
            active = self._active.get(condition)
            if active is None:
                self._active[condition] = _Active(message, now)
                line = message
            else:
                active.repeats += 1
                active.message = message
                elapsed_s = now - active.said_at_s
                if elapsed_s < self._summary_interval_s:
                    return False
                line = f"{message} (again: {active.repeats} more time(s) in the last {elapsed_s:.0f} s)"
                active.repeats = 0
                active.said_at_s = now
        self._logger.log(level, PREFIX + line)
        return True

    def clear(self, condition: str, message: str | None = None) -> None:
        """End ``condition``: log ``message`` (INFO), with the count of repeats not yet said;
        with no message, a condition that repeated still says how often, and what it was."""
        with self._lock:
            active = self._active.pop(condition, None)
        if active is None:
            return
        if message and active.repeats:
            self._logger.info(PREFIX + f"{message} (after {active.repeats} more time(s) since it was said)")
        elif message:
            self._logger.info(PREFIX + message)
        elif active.repeats:
            self._logger.info(PREFIX + f"cleared after {active.repeats} more time(s): {active.message}")
