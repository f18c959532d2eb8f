"""Running the gateway as a process: signals, readiness and the embedded parent's lifetime."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from kvharbor.config import Config
from kvharbor.gateway.server import Gateway, GatewayStartError
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")


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


def run_gateway(config: Config, start_clean: bool, ready_fd: int | None = None, parent_fd: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or the parent's exit); returns the exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    gateway = Gateway(config, start_clean=start_clean)
    try:
        gateway.start()
    except GatewayStartError as err:
        _log.error("kvharbor: gateway cannot start: %s", err)
        gateway.stop()
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        _log.info("kvharbor: gateway received %s", signal.Signals(signum).name)
        threading.Thread(target=gateway.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parent_fd is not None:
        threading.Thread(target=_watch_parent, args=(parent_fd, gateway), daemon=True).start()
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    gateway.serve_forever()
    gateway.stop()
    return 0
