"""An embedded gateway that is no descendant of its engine: a double fork.

vLLM's shutdown kills every descendant of its engine-core and worker processes,
whatever their session: `vllm.utils.system_utils.kill_process_tree` walks
psutil's ``children(recursive=True)`` and sends each SIGKILL (at once with the
default ``--shutdown-timeout 0``). A gateway meant to outlive its engine
(``gateway.linger_s``) therefore must not be one of them.

The engine starts ``kvharbor gateway --embedded`` (the intermediate). Once its
config is read, and before it starts a thread or opens the store, it forks
the gateway, writes ``pid N`` on the starter's ready pipe and exits; the
gateway is reparented (to init, or the nearest subreaper) and later writes
``ready`` on the same pipe, which it inherited. So the starter learns the real
pid, still waits for readiness on one pipe, and reaps the intermediate at once.

The gateway's output goes to a log file beside its socket, not to the engine's:
a process that outlives the engine must not hold the engine's stdout or
stderr open (a pipe reading them would not end until the gateway does).
"""

from __future__ import annotations

import contextlib
import os
import select
from pathlib import Path

LOG_SUFFIX = ".log"


def log_path(socket_path: Path) -> Path:
    """Where an embedded gateway serving ``socket_path`` writes its log."""
    return socket_path.with_name(socket_path.name + LOG_SUFFIX)


def detach(ready_fd: int, log: Path) -> None:
    """Fork the gateway and return in it only; the calling process (the intermediate)
    reports the gateway's pid on ``ready_fd`` and exits.

    Call it before any thread starts: only the calling thread survives a fork.
    """
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:
        # The gateway: its output to the log, the engine's stdout and stderr let go.
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        return
    # The starter may be gone already: the gateway then finds out itself when it reports ready.
    with contextlib.suppress(BrokenPipeError):
        os.write(ready_fd, f"pid {pid}\n".encode())
    os._exit(0)  # Not sys.exit: nothing of this process (atexit, buffers) is the intermediate's to run.


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait for a process that is not our child (a detached gateway) to exit, through a
    pidfd; False if it still runs after ``timeout_s``. True for a pid that is gone already."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        exited, _, _ = select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)
    return bool(exited)
