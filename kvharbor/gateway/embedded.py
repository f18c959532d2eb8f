"""Embedded mode: the first client on a host starts the gateway; the others attach.

With ``gateway.mode: embedded`` (the default) a client that finds no gateway
starts one running the same code, so a single engine needs no separate
service. Several clients (tensor-parallel ranks) may race: a file lock beside
the socket lets exactly one of them start it while the others wait for it to
be ready.

The gateway is no descendant of the engine (`kvharbor.gateway.detach`): vLLM's
shutdown kills every descendant of its processes. Its clients decide its life
(`kvharbor.gateway.lifetime`): it serves while any is attached and lingers
``gateway.linger_s`` after the last one detached, so an engine restarted
within that window restores from its RAM tier. With ``linger_s: 0`` it lives
exactly as long as the process that started it: it watches a pipe whose write
end only that process holds (a process forked from it lets go of its copy at once).

A lingering gateway dies with its container (its PID namespace): in containers,
use a sidecar or a service-mode gateway to keep the RAM tier across engine restarts.

Only "nothing listens on the socket" starts a gateway, or an idle embedded
gateway that steps aside for this client (another release; its segment
removed by hand): once it has exited, this client starts its own. A gateway
that answers but cannot be used otherwise (another release with clients,
another config, a user it does not admit, a segment this process cannot open)
is reported as it is: starting a second one could not fix it. Engines of
different storage configs find different gateways when ``gateway.socket`` is
left ``derived`` (`kvharbor.config.gateway_address`).

The files kept beside the socket (the start lock, the child's config) get the
access of ``gateway.access``, like the socket and the segment.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.config import Config, validate_config
from kvharbor.gateway.access import AccessPolicy
from kvharbor.gateway.client import GatewayClient, GatewayError, GatewayNotRunning, GatewaySteppingAside
from kvharbor.gateway.detach import log_path, wait_for_exit
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway.embedded")

LOG_TAIL_BYTES = 2000
"""How much of a gateway's log a failed start quotes."""

# Write ends of the lifetime pipes of the gateways this process started with
# linger_s 0. Held until the process exits; the pipes' closing stops them.
_LIFELINES: list[int] = []
_STARTED: list[int] = []
"""Pids of the gateways this process started."""


def started_here() -> tuple[int, ...]:
    """The pids of the embedded gateways this process started (not merely attached to)."""
    return tuple(_STARTED)


def _drop_lifelines_after_fork() -> None:
    """In a forked child (an engine's worker): the write ends are not its to hold, or
    the gateway would outlive the process that started it for as long as the child runs."""
    for fd in _LIFELINES:
        os.close(fd)
    _LIFELINES.clear()
    _STARTED.clear()


os.register_at_fork(after_in_child=_drop_lifelines_after_fork)


def connect(config: Config, client_name: str, layouts: Sequence[LayoutFingerprint] = ()) -> GatewayClient:
    """Connect to the configured gateway, starting an embedded one if none answers;
    ``layouts`` are registered at the handshake (see `GatewayClient.connect`).

    Raises `GatewayError` when there is none and none can be started.
    """
    section = config.gateway
    try:
        return GatewayClient.connect(section, client_name, layouts=layouts)
    except GatewayNotRunning:
        if section.mode != "embedded":
            raise
    except GatewaySteppingAside as err:
        if section.mode != "embedded":
            raise
        _wait_for_exit(err, section.embedded_start_timeout_ms)
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
            return GatewayClient.connect(section, client_name, layouts=layouts)
        except GatewayNotRunning:
            pass
        _start_child(config, access)
    finally:
        os.close(lock)
    return GatewayClient.connect(section, client_name, layouts=layouts)


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


def _wait_for_exit(stepping_aside: GatewaySteppingAside, timeout_ms: int) -> None:
    """Wait for a gateway that steps aside to have exited (and released its socket's lock)."""
    pid = stepping_aside.gateway_pid
    # pid 0: not visible from here (another PID namespace); the start below says if it is still there.
    if pid and not wait_for_exit(pid, timeout_ms / 1000):
        raise GatewayError(
            f"the embedded gateway (pid {pid}) that stepped aside did not exit within {timeout_ms} ms "
            f"(gateway.embedded_start_timeout_ms): {stepping_aside}"
        )
    _log.info("kvharbor: %s; it has exited, starting a new one", stepping_aside)


def _read_until_closed(fd: int, deadline: float) -> bytes | None:
    """Everything written to a pipe until its writers closed it; None past ``deadline``."""
    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return data
        data += chunk


def _start_child(config: Config, access: AccessPolicy) -> None:
    """Start the gateway through an intermediate that forks it and exits (`kvharbor.gateway.detach`);
    return once it serves. Raises `GatewayError` saying why it does not."""
    section = config.gateway
    socket_path = Path(section.socket)
    config_path = socket_path.with_name(socket_path.name + ".config.json")
    try:
        _write_config(config, config_path, access)
    except OSError as err:
        raise GatewayError(
            f"cannot write the embedded gateway's config {config_path}: {err.strerror or err}; "
            "check gateway.socket and gateway.access"
        ) from None
    ready_read, ready_write = os.pipe()
    command = [sys.executable, "-m", "kvharbor", "gateway", "--config", str(config_path), "--embedded",
               "--ready-fd", str(ready_write)]  # fmt: skip
    passed = [ready_write]
    life_read = life_write = -1
    if section.linger_s == 0:
        life_read, life_write = os.pipe()
        command += ["--parent-fd", str(life_read)]
        passed.append(life_read)
    started = time.monotonic()
    timeout_s = section.embedded_start_timeout_ms / 1000
    # A session of its own: the terminal's Ctrl-C goes to the engine, not to the gateway.
    intermediate = subprocess.Popen(command, pass_fds=passed, stdin=subprocess.DEVNULL, start_new_session=True)
    for fd in passed:
        os.close(fd)
    if life_write >= 0:
        _LIFELINES.append(life_write)
    try:
        # "pid N" from the intermediate, then "ready" from the gateway; then both let go of the pipe.
        answer = _read_until_closed(ready_read, started + timeout_s)
    finally:
        os.close(ready_read)
    pid_line, _, rest = (answer or b"").partition(b"\n")
    pid = int(pid_line.removeprefix(b"pid ")) if pid_line.startswith(b"pid ") else None
    if answer is None:
        # Past the deadline: end what runs of it, so that it cannot serve later, unseen.
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        intermediate.kill()
    code = intermediate.wait()
    limit = f"within {section.embedded_start_timeout_ms} ms (gateway.embedded_start_timeout_ms)"
    if pid is None:  # It failed before it forked the gateway (the config, the interpreter).
        state = "did not start" if answer is None else f"exited with code {code}"
        raise GatewayError(f"the embedded gateway {state} {limit}; its log above says why")
    if rest != b"ready\n":
        state = "did not become ready" if answer is None else "exited before it was ready"
        raise GatewayError(f"the embedded gateway (pid {pid}) {state} {limit}; {_log_tail(log_path(socket_path))}")
    _STARTED.append(pid)
    lifetime = (
        "it lives as long as this process (gateway.linger_s 0)"
        if section.linger_s == 0
        else f"it lingers {section.linger_s:g} s after its last client detaches (gateway.linger_s)"
    )
    _log.info(
        "kvharbor: started an embedded gateway (pid %d) in %.1f s; %s; its log: %s",
        pid, time.monotonic() - started, lifetime, log_path(socket_path),
    )  # fmt: skip


def _log_tail(path: Path) -> str:
    """The end of a gateway's log, for the message of a start that failed."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = log.read().decode(errors="replace").strip()
    except OSError as err:
        return f"its log {path} cannot be read ({err.strerror})"
    return f"its log {path} says why:\n{tail}"
