"""Embedded mode: the first client on a host starts the gateway; the others attach.

With ``gateway.mode: embedded`` (the default) a client that finds no gateway
starts one as a child process running the same code, so a single engine needs
no separate service. Several clients (tensor-parallel ranks) may race: a file
lock beside the socket lets exactly one of them start it while the others wait
for it to be ready. The child lives as long as the process that started it:
it watches a pipe whose write end only that process holds (a process forked
from it lets go of its copy at once).

Only "nothing listens on the socket" starts a gateway. A gateway that answers
but cannot be used (another release, another config, a user it does not admit,
a segment this process cannot open) is reported as it is: starting a second one
could not fix it. Engines of different storage configs find different gateways
when ``gateway.socket`` is left ``derived`` (`kvharbor.config.gateway_address`).

The files kept beside the socket (the start lock, the child's config) get the
access of ``gateway.access``, like the socket and the segment.
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

from kvharbor.config import Config, validate_config
from kvharbor.gateway.access import AccessPolicy
from kvharbor.gateway.client import GatewayClient, GatewayError, GatewayNotRunning
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway.embedded")

# Write ends of the lifetime pipes of the gateways this process started, and
# the children themselves. Held until the process exits; the pipes' closing is
# what stops the children.
_LIFELINES: list[int] = []
_CHILDREN: list[subprocess.Popen[bytes]] = []


def _drop_lifelines_after_fork() -> None:
    """In a forked child (an engine's worker): the write ends are not its to hold, or
    the gateway would outlive the process that started it for as long as the child runs."""
    for fd in _LIFELINES:
        os.close(fd)
    _LIFELINES.clear()
    _CHILDREN.clear()


os.register_at_fork(after_in_child=_drop_lifelines_after_fork)


def connect(config: Config, client_name: str) -> GatewayClient:
    """Connect to the configured gateway, starting an embedded one if none answers.

    Raises `GatewayError` when there is none and none can be started.
    """
    section = config.gateway
    try:
        return GatewayClient.connect(section, client_name)
    except GatewayNotRunning:
        if section.mode != "embedded":
            raise
    socket_path = Path(section.socket)
    access = AccessPolicy(section.access)
    lock_path = socket_path.with_name(socket_path.name + ".spawn")
    try:
        access.make_directory(socket_path.parent)
        lock = access.open_file(lock_path)
    except OSError as err:
        raise GatewayError(
            f"cannot start an embedded gateway: {err.filename or lock_path}: {err.strerror or err}; "
            "choose a gateway.socket in a directory this user can write (and gateway.access for other users)"
        ) from None
    try:
        # Held while one client starts the gateway; the others wait here, then
        # connect. The wait is bounded by the starter's embedded_start_timeout_ms.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return GatewayClient.connect(section, client_name)
        except GatewayNotRunning:
            pass
        _start_child(config, access)
    finally:
        os.close(lock)
    return GatewayClient.connect(section, client_name)


def _write_config(config: Config, path: Path, access: AccessPolicy) -> None:
    """The child's config, exactly ours: tiers are dumped as their own types
    (``serialize_as_any``), or a file tier would lose its ``path``."""
    document = config.model_dump(mode="json", serialize_as_any=True)
    assert validate_config(document) == config, "the config must survive its round trip"
    staging = path.with_name(path.name + f".{os.getpid()}")
    staging.unlink(missing_ok=True)
    with os.fdopen(access.open_file(staging), "w") as file:
        file.write(json.dumps(document))
    staging.replace(path)


def _start_child(config: Config, access: AccessPolicy) -> None:
    section = config.gateway
    config_path = Path(section.socket).with_name(Path(section.socket).name + ".config.json")
    try:
        _write_config(config, config_path, access)
    except OSError as err:
        raise GatewayError(
            f"cannot write the embedded gateway's config {config_path}: {err.strerror or err}; "
            "check gateway.socket and gateway.access"
        ) from None
    ready_read, ready_write = os.pipe()
    life_read, life_write = os.pipe()
    command = [
        sys.executable, "-m", "kvharbor", "gateway", "--config", str(config_path),
        "--ready-fd", str(ready_write), "--parent-fd", str(life_read),
    ]  # fmt: skip
    started = time.monotonic()
    # A session of its own: the terminal's Ctrl-C goes to the engine, which then
    # exits and so stops the gateway through the lifeline, in that order.
    child = subprocess.Popen(
        command, pass_fds=(ready_write, life_read), stdin=subprocess.DEVNULL, start_new_session=True
    )
    os.close(ready_write)
    os.close(life_read)
    _LIFELINES.append(life_write)
    _CHILDREN.append(child)
    try:
        timeout_s = section.embedded_start_timeout_ms / 1000
        ready, _, _ = select.select([ready_read], [], [], timeout_s)
        answer = os.read(ready_read, 16) if ready else b""
    finally:
        os.close(ready_read)
    if answer != b"ready\n":
        try:
            # The pipe closed without "ready": the child is exiting; reap it for its status.
            code = child.wait(timeout_s if ready else 0)
            state = f"exited with code {code}"
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            state = "did not become ready"
        raise GatewayError(
            f"the embedded gateway (pid {child.pid}) {state} within {section.embedded_start_timeout_ms} ms "
            "(gateway.embedded_start_timeout_ms); its log above says why"
        )
    _log.info(
        "kvharbor: started an embedded gateway (pid %d) in %.1f s; it lives as long as this process",
        child.pid,
        time.monotonic() - started,
    )
