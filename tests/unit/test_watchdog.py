"""The gateway's request watchdog: a request past its threshold is said once, with the stacks."""

from __future__ import annotations

import logging
import threading

from kvharbor.gateway import protocol as p
from kvharbor.gateway.watchdog import RequestWatchdog


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.said = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.said.set()


def test_a_request_past_the_threshold_is_said_once_with_every_threads_stack() -> None:
    lines = Lines()
    logger = logging.getLogger("kvharbor.gateway")
    logger.addHandler(lines)
    watchdog = RequestWatchdog(threshold_s=0.05).start()
    release = threading.Event()

    def hung_request() -> None:
        watchdog.begin(p.MessageType.PUT_COMMIT, "client 'saver' (pid 1)")
        release.wait(60)  # Stands for a store that does not return.
        watchdog.end()

    serving = threading.Thread(target=hung_request, name="serving")
    serving.start()
    try:
        assert lines.said.wait(30), "the watchdog never said the hung request"
        release.set()
        serving.join()
        watchdog.stop()
    finally:
        release.set()
        logger.removeHandler(lines)
    [message] = lines.messages  # Once, however long it lasted.
    assert message.startswith("kvharbor: a PUT_COMMIT request from client 'saver' (pid 1) has been served for")
    assert "thread serving:" in message and "in hung_request" in message


def test_requests_that_end_in_time_are_not_said() -> None:
    lines = Lines()
    logger = logging.getLogger("kvharbor.gateway")
    logger.addHandler(lines)
    watchdog = RequestWatchdog(threshold_s=30).start()
    try:
        for _ in range(1000):
            watchdog.begin(p.MessageType.LOOKUP, "client")
            watchdog.end()
        watchdog.stop()
    finally:
        logger.removeHandler(lines)
    assert lines.messages == []
