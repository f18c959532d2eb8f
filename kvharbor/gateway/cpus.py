"""Which CPUs the gateway runs on (``gateway.cpus``), not the ones its starter was bound to.

A process inherits its parent's CPU binding. An embedded gateway's parent is an engine's
worker, and vLLM's CPU backend binds each worker to cores of its own: on a 2-core machine
the gateway then shares one core with a worker that keeps it busy while it waits for its
saves, and was seen answering a commit only after 6 s, past ``gateway.request_timeout_ms``,
which turns the engine's cache off. So the gateway places itself at start: on the CPUs the
setting names, or on every CPU its host and cgroup allow.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")


class CpusUnusable(Exception):
    """None of the CPUs ``gateway.cpus`` names may be used here; the message says which exist."""


def place_on_cpus(cpus: Sequence[int] | None) -> frozenset[int] | None:
    """Bind this process (and the threads it starts after) to ``cpus``, or to every CPU the
    kernel lets it use when None; returns the CPUs it now runs on, or None where the
    platform has no CPU binding. Raises `CpusUnusable` when ``cpus`` are none of them."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    before = frozenset(os.sched_getaffinity(0))
    wanted = range(os.cpu_count() or 1) if cpus is None else cpus
    try:
        # The kernel keeps the CPUs of the mask its cpuset allows: the whole range is
        # every CPU this cgroup may use, whatever the starter was bound to.
        os.sched_setaffinity(0, wanted)
    except (OSError, ValueError) as err:
        if cpus is None:  # The whole range holds every allowed CPU: the platform refuses binding.
            _log.warning("kvharbor: the gateway keeps its starter's CPUs %s: %s", _ranges(before), err)
            return before
        raise CpusUnusable(
            f"gateway.cpus {list(cpus)} names no CPU this process may use ({err}); "
            f"this host has CPUs 0-{(os.cpu_count() or 1) - 1}"
        ) from None
    after = frozenset(os.sched_getaffinity(0))
    assert after, "sched_setaffinity left no CPU"
    if after != before:
        _log.info(
            "kvharbor: the gateway runs on CPUs %s (gateway.cpus; it was started bound to %s)",
            _ranges(after), _ranges(before),
        )  # fmt: skip
    return after


def _ranges(cpus: frozenset[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``, the way the kernel writes CPU lists."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
