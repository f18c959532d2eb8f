"""Log conventions: every kvharbor line starts with ``kvharbor:``; faults are said once.

A degraded cache must say so clearly but must not flood the engine's log at
request rate: `OnceLog` says a condition when it starts and again only after
it has cleared and come back.
"""

from __future__ import annotations

import logging
import threading

PREFIX = "kvharbor: "


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def attach_to_engine_log(level: int = logging.INFO) -> None:
    """Make ``kvharbor.*`` lines appear in a host process (an engine) that configured
    logging only for its own loggers. Does nothing if the root logger or
    ``kvharbor`` already has a handler."""
    root = logging.getLogger("kvharbor")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)


class OnceLog:
    """Says each named condition once, until `clear` re-arms it."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._active: set[str] = set()
        self._lock = threading.Lock()

    def say(self, condition: str, message: str, level: int = logging.WARNING) -> bool:
        """Log ``message`` unless ``condition`` is already active; True if logged."""
        with self._lock:
            if condition in self._active:
                return False
            self._active.add(condition)
        self._logger.log(level, PREFIX + message)
        return True

    def clear(self, condition: str, message: str | None = None) -> None:
        with self._lock:
            if condition not in self._active:
                return
            self._active.discard(condition)
        if message:
            self._logger.info(PREFIX + message)
