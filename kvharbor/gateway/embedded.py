"""Embedded mode: the first client on a host starts the gateway; the others attach.

With ``gateway.mode: embedded`` (the default) a client that finds no gateway
starts one as a child process running the same code, so a single engine needs
no separate service. Several clients (tensor-parallel ranks) may race: a file
lock beside the socket lets exactly one of them start it while the others wait
for it to be ready. The child lives as long as the process that started it:
it watches a pipe whose write end only that process holds.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from kvharbor.config import Config
from kvharbor.gateway.client import GatewayClient, GatewayError, GatewayUnavailable
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway.embedded")

# Write ends of the lifetime pipes of the gateways this process started. Held
# until the process exits; their closing is what stops the child.
_LIFELINES: list[int] = []


def connect(config: Config, client_name: str) -> GatewayClient:
    """Connect to the configured gateway, starting an embedded one if none answers.

    Raises `GatewayError` when there is none and none can be started.
    """
    section = config.gateway
    try:
        return GatewayClient.connect(section, client_name)
    except GatewayUnavailable:
        if section.mode != "embedded":
            raise
    socket_path = Path(section.socket)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = socket_path.with_name(socket_path.name + ".spawn")
    with open(lock_path, "a+") as lock:
        # Held while one client starts the gateway; the others wait here, then connect.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return GatewayClient.connect(section, client_name)
        except GatewayUnavailable:
            pass
        _start_child(config)
    return GatewayClient.connect(section, client_name)


def _start_child(config: Config) -> None:
    section = config.gateway
    config_path = Path(section.socket).with_name(Path(section.socket).name + ".config.json")
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    ready_read, ready_write = os.pipe()
    life_read, life_write = os.pipe()
    command = [
        sys.executable, "-m", "kvharbor", "gateway", "--config", str(config_path),
        "--ready-fd", str(ready_write), "--parent-fd", str(life_read),
    ]  # fmt: skip
    started = time.monotonic()
    child = subprocess.Popen(command, pass_fds=(ready_write, life_read), stdin=subprocess.DEVNULL)
    os.close(ready_write)
    os.close(life_read)
    _LIFELINES.append(life_write)
    try:
        timeout_s = section.embedded_start_timeout_ms / 1000
        ready, _, _ = select.select([ready_read], [], [], timeout_s)
        answer = os.read(ready_read, 16) if ready else b""
    finally:
        os.close(ready_read)
    if answer != b"ready\n":
        child.poll()
        state = f"exited with code {child.returncode}" if child.returncode is not None else "did not become ready"
        if child.returncode is None:
            child.kill()
        raise GatewayError(
            f"the embedded gateway (pid {child.pid}) {state} within {section.embedded_start_timeout_ms} ms "
            "(gateway.embedded_start_timeout_ms); its log above says why"
        )
    _log.info(
        "kvharbor: started an embedded gateway (pid %d) in %.1f s; it lives as long as this process",
        child.pid,
        time.monotonic() - started,
    )
