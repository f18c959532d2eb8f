"""Names of in-flight temp files, and when one is abandoned.

A file-backed put writes a temp file and renames it over the final name. A
writer that dies between the two leaves its temp file behind. The name says
who wrote it, so a later opener can tell a dead writer's leftover from a live
writer's work in progress::

    <stem>.<host>.<pid namespace>.<pid>.<thread>.<counter>.tmp

The host may contain dots, so the name is parsed from the right. pid + thread
id + counter make the name unique without a lock: two threads never share a
thread id, and one thread never reuses a counter value.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from dataclasses import dataclass

TEMP_SUFFIX = ".tmp"

_counter = itertools.count()
_FIELDS_AFTER_HOST = 4  # pid namespace, pid, thread, counter.


@dataclass(frozen=True, slots=True)
class Machine:
    """Where a writer runs: a pid means something only on one host, in one pid namespace."""

    host: str
    pid_namespace: int


def this_machine() -> Machine:
    return Machine(socket.gethostname(), _pid_namespace())


def _pid_namespace() -> int:
    # Containers on one host may share a host name yet number pids apart.
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def temp_name(stem: str, machine: Machine) -> str:
    """A fresh temp file name for this process and thread (pid read now: forks differ)."""
    assert "." not in stem, stem
    fields = (stem, machine.host, machine.pid_namespace, os.getpid(), threading.get_native_id())
    return ".".join(str(f) for f in (*fields, next(_counter))) + TEMP_SUFFIX


def parse_writer(name: str) -> tuple[Machine, int] | None:
    """The machine and pid named in a temp file's name; None if the name is not ours."""
    if not name.endswith(TEMP_SUFFIX):
        return None
    fields = name[: -len(TEMP_SUFFIX)].split(".")
    if len(fields) < 2 + _FIELDS_AFTER_HOST:
        return None
    host = ".".join(fields[1:-_FIELDS_AFTER_HOST])
    try:
        pid_namespace, pid = int(fields[-4]), int(fields[-3])
    except ValueError:
        return None
    return (Machine(host, pid_namespace), pid) if pid > 0 else None


def pid_alive(pid: int) -> bool:
    assert pid > 0, pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # It exists; it belongs to another user.
    return True


def abandoned(name: str, age_s: float, here: Machine, stale_after_s: float) -> bool:
    """Whether a temp file can be removed without hurting a live writer.

    On this machine a dead pid proves it. Elsewhere (another host sharing the
    directory over NFS) nothing can be proven, so only age counts: no put
    takes ``stale_after_s``. Age also clears a dead writer whose pid has since
    been reused.
    """
    if age_s > stale_after_s:
        return True
    writer = parse_writer(name)
    if writer is None:
        return False
    machine, pid = writer
    return machine == here and not pid_alive(pid)
