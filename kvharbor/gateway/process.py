"""Running the gateway as a process: signals, readiness and the embedded parent's lifetime."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from kvharbor import __version__
from kvharbor.config import Config
from kvharbor.gateway.cpus import CpusUnusable, place_on_cpus
from kvharbor.gateway.heap import keep_freed_memory
from kvharbor.gateway.server import Gateway, GatewayStartError
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")

EXIT_OK = 0
EXIT_CANNOT_START = 2
"""The same status as a bad config: the message says what to change."""
EXIT_ORPHANED = 3
"""An embedded gateway whose engine went away before it was ready."""


def _watch_parent(parent_fd: int, gateway: Gateway) -> None:
    """Stop when the embedding engine goes: it holds the pipe's write end, so its
    exit (however it dies) closes the pipe and this read returns."""
    try:
        while os.read(parent_fd, 1):
            pass
    except OSError:
        pass
    _log.info("kvharbor: the engine that started this embedded gateway exited; stopping")
    gateway.stop()


def _signal_ready(ready_fd: int) -> bool:
    """Tell the starter we serve; False if it is gone already (the pipe is closed)."""
    try:
        os.write(ready_fd, b"ready\n")
    except BrokenPipeError:
        return False
    finally:
        os.close(ready_fd)
    return True


def run_gateway(
    config: Config,
    start_clean: bool,
    ready_fd: int | None = None,
    parent_fd: int | None = None,
    linger_s: float = 0.0,
    config_path: Path | None = None,
    release: str = __version__,
) -> int:
    """Serve until SIGTERM/SIGINT (or the parent's exit, or idle for ``linger_s``); returns the exit status.

    ``ready_fd``: a pipe to write ``ready`` to once clients can connect.
    ``parent_fd``: the read end of a pipe whose writer is the process this
    gateway lives for (embedded mode, ``linger_s`` 0); its closing stops the gateway.
    ``linger_s`` > 0: an embedded gateway whose clients decide its life (`kvharbor.gateway.lifetime`).
    ``config_path``: the file ``config`` was read from (the dashboard writes its edits there).
    ``release``: the release it serves as (`Gateway`; another only where a scenario asks).
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        place_on_cpus(config.gateway.cpus)  # Before any thread starts: they inherit it.
    except CpusUnusable as err:
        _log.error("kvharbor: gateway cannot start: %s", err)
        return EXIT_CANNOT_START
    keep_freed_memory()  # Before the store allocates anything.
    gateway = Gateway(config, start_clean=start_clean, linger_s=linger_s, config_path=config_path, release=release)
    try:
        gateway.start()
    except GatewayStartError as err:
        _log.error("kvharbor: gateway cannot start: %s", err)
        gateway.stop()
        return EXIT_CANNOT_START
    except BaseException:
        gateway.stop()  # Whatever broke, leave no segment or socket behind.
        raise

    def on_signal(signum: int, _frame: object) -> None:
        _log.info("kvharbor: gateway received %s; stopping", signal.Signals(signum).name)
        # Not here: stop() joins client threads, and a handler runs on the main thread
        # between bytecodes of serve_forever.
        threading.Thread(target=gateway.stop, daemon=True, name="kvharbor-stop").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parent_fd is not None:
        threading.Thread(target=_watch_parent, args=(parent_fd, gateway), daemon=True, name="kvharbor-parent").start()
    if ready_fd is not None and not _signal_ready(ready_fd):
        _log.error("kvharbor: the process that started this gateway went away before it was ready; stopping")
        gateway.stop()
        return EXIT_ORPHANED
    try:
        gateway.serve_forever()
    finally:
        gateway.stop()  # Waits for a stop already under way on another thread.
    return EXIT_OK
