"""The gateway runs on the CPUs ``gateway.cpus`` names, or on all of them: never only on
the cores its starter (an engine's worker, bound by vLLM's CPU backend) was bound to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvharbor.config import load_config
from kvharbor.gateway.detach import log_path
from tests.gateway.gateway_harness import Lab

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="CPU binding needs a platform that has it and two CPUs to tell apart",
)


def cpus_of(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def test_an_embedded_gateway_leaves_its_starters_cpu_binding(lab: Lab) -> None:
    every = cpus_of(0)
    first = min(every)
    config_path = lab.config(mode="embedded", linger_s=0)
    config = load_config(config_path, environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    # Bound as vLLM's CPU backend binds a worker: to one core of its own.
    starter = lab.worker("embedded", str(config_path), preexec_fn=lambda: os.sched_setaffinity(0, {first}))
    pid_word, how = starter.line().split()
    gateway_pid = int(pid_word)
    lab.detached.add(gateway_pid)
    assert how == "started"
    assert cpus_of(starter.process.pid) == {first}
    assert cpus_of(gateway_pid) == every
    log = log_path(Path(config.gateway.socket)).read_text()
    assert f"started bound to {first}" in log


def test_gateway_cpus_binds_a_service_gateway(lab: Lab) -> None:
    last = max(cpus_of(0))
    gateway = lab.gateway(lab.config(cpus=[last])).start()
    assert cpus_of(gateway.pid) == {last}
    assert "gateway.cpus" in gateway.log()


def test_gateway_cpus_naming_no_usable_cpu_refuses_start(lab: Lab) -> None:
    missing = (os.cpu_count() or 1) + 7
    gateway = lab.gateway(lab.config(cpus=[missing])).start(expect_ready=False)
    assert gateway.wait() == 2
    log = gateway.log()
    assert f"gateway.cpus [{missing}] names no CPU this process may use" in log
    assert "Traceback" not in log
