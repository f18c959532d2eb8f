"""Pages queued for storage are written before SGLang stops its storage threads.

SGLang's HiCache controller queues a page write (a backup) once the page is in
its host pool; a background thread stores the queue. At shutdown (and on
detach) it sets a stop event and joins that thread, which then leaves whatever
is still queued unwritten: a restart right after a long prompt would miss it.
`flush_backups` writes the queue out first, through the controller's own backup
path, for at most ``sglang.shutdown_flush_ms``; what is left after it is said once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty
from typing import Any

from kvharbor.telemetry.log import PREFIX, get_logger

_log = get_logger("kvharbor.connector.sglang")


@dataclass(frozen=True, slots=True)
class FlushReport:
    written: int
    """Queued writes stored by the flush."""
    left: int
    """Queued writes still unwritten at the deadline."""


def flush_backups(controller: Any, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> FlushReport:
    """Store the writes queued on ``controller`` (SGLang's HiCacheController) until the
    queue is empty or ``deadline_s`` has passed; the backup thread may go on beside it."""
    queue = getattr(controller, "backup_queue", None)
    if queue is None:
        return FlushReport(0, 0)
    end = clock() + deadline_s
    written = 0
    while clock() < end:
        try:
            operation = queue.get_nowait()
        except Empty:
            break
        if operation is None:
            continue  # A stop sentinel.
        if not controller.backup_skip:
            controller._page_backup_or_log(operation)
        controller.ack_backup_queue.put(operation)
        written += 1
    left = sum(1 for item in list(queue.queue) if item is not None)
    if written or left:
        _log.warning(
            "%sSGLang shutdown: %d queued page write(s) stored, %d not stored within sglang.shutdown_flush_ms "
            "(%d ms)",
            PREFIX, written, left, int(deadline_s * 1000),
        )  # fmt: skip
    return FlushReport(written, left)


def flush_if_kvharbor(controller: Any) -> FlushReport | None:
    """`flush_backups` when kvharbor is ``controller``'s working storage backend."""
    from kvharbor.connector.sglang.backend import KVHarborStorage

    backend = getattr(controller, "storage_backend", None)
    backend = getattr(backend, "_backend", backend)  # SGLang's test failure injector wraps backends.
    stop = getattr(controller, "storage_stop_event", None)
    if not isinstance(backend, KVHarborStorage) or not backend.is_on or stop is None or stop.is_set():
        return None
    return flush_backups(controller, backend.flush_ms / 1000)
