"""What a client can see when its gateway stays silent past ``gateway.request_timeout_ms``.

The client gives up and turns the cache off for good; the gateway's own log may say
nothing (its serving thread may never have got the whole request). So the timeout's
message carries what the kernel knows at that moment, which tells the cases apart:

- the request still in this socket's send queue: the gateway stopped reading (the
  kernel counts a queued message's buffer, some hundred bytes more than its length);
- bytes waiting in the receive queue: an answer came after the deadline (a slow gateway);
- the gateway's threads by scheduler state (R running, S sleeping, D in uninterruptible
  I/O, T stopped) with the kernel function each sleeps in: all in ``futex_wait`` is a
  lock or the interpreter lock held by one thread; a D thread names the I/O.

Everything here is read-only and best effort: a field that cannot be read is left out.
"""

from __future__ import annotations

import collections
import fcntl
import socket
import struct
from pathlib import Path

from kvharbor.gateway.access import peer_of

_SIOCINQ = 0x541B  # FIONREAD: bytes waiting to be read.
_SIOCOUTQ = 0x5411  # TIOCOUTQ: bytes not yet taken by the peer.
_INT = struct.Struct("@i")
THREADS_NAMED_MAX = 8
"""How many of the gateway's threads the message names with their kernel wait."""


def _queued(sock: socket.socket, request: int) -> int | None:
    try:
        return int(_INT.unpack(fcntl.ioctl(sock.fileno(), request, b"\0" * _INT.size))[0])
    except OSError:
        return None


def _threads(pid: int) -> str | None:
    """The process's threads as ``name:state:wchan``, the busiest states first."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        entries = sorted(tasks.iterdir(), key=lambda p: int(p.name))
    except OSError:
        return None
    states: collections.Counter[str] = collections.Counter()
    named: list[str] = []
    for task in entries:
        try:
            stat = (task / "stat").read_text()
            wchan = (task / "wchan").read_text().strip() or "-"
        except OSError:
            continue  # The thread ended meanwhile.
        # comm is in parentheses and may hold spaces; the state follows the last ')'.
        comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        states[state] += 1
        if len(named) < THREADS_NAMED_MAX:
            named.append(f"{comm}:{state}:{wchan}")
    counts = " ".join(f"{state}x{n}" for state, n in states.most_common())
    return f"{counts} [{', '.join(named)}]"


def describe_silence(sock: socket.socket) -> str:
    """One line on the state of ``sock`` and of the gateway process at its other end:
    ``send queue 0 B; receive queue 0 B; gateway pid 7 threads Sx5 [name:S:futex_wait, ...]``."""
    parts = []
    unsent, unread = _queued(sock, _SIOCOUTQ), _queued(sock, _SIOCINQ)
    if unsent is not None:
        parts.append(f"send queue {unsent} B")
    if unread is not None:
        parts.append(f"receive queue {unread} B")
    try:
        pid = peer_of(sock).pid
    except OSError:
        pid = 0
    threads = _threads(pid) if pid > 0 else None
    if threads is not None:
        parts.append(f"gateway pid {pid} threads {threads}")
    elif pid > 0:
        parts.append(f"gateway pid {pid} is gone")
    return "; ".join(parts)
