"""The page's "recent log lines": a bounded buffer fed by a handler on the ``kvharbor`` logger.

Only INFO and above: those are the lines kvharbor means a user to read (a tier that
degrades, a client that died mid-transfer, a refusal); each repeated condition is
said once already (`kvharbor.telemetry.log.OnceLog`), so the buffer holds events, not
request-rate noise.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

KVHARBOR_LOGGER = "kvharbor"


@dataclass(frozen=True, slots=True)
class LogLine:
    time_s: float
    level: str
    message: str


class RecentLog(logging.Handler):
    """Keeps the last ``lines_max`` records of the ``kvharbor`` logger while attached."""

    def __init__(self, lines_max: int) -> None:
        super().__init__(level=logging.INFO)
        self._lines: deque[LogLine] = deque(maxlen=lines_max)
        self._lines_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = LogLine(record.created, record.levelname, record.getMessage())
        except Exception:  # A bad format string must not break the line's other handlers.
            self.handleError(record)
            return
        with self._lines_lock:
            self._lines.append(line)

    def attach(self) -> None:
        """Records the ``kvharbor`` loggers let through (their levels stay as the process set them)."""
        logging.getLogger(KVHARBOR_LOGGER).addHandler(self)

    def detach(self) -> None:
        logging.getLogger(KVHARBOR_LOGGER).removeHandler(self)

    def document(self) -> list[dict[str, Any]]:
        with self._lines_lock:
            return [asdict(line) for line in self._lines]
