"""Embedded mode: the first client starts the gateway, the others attach; with
``linger_s: 0`` the gateway lives exactly as long as the process that started it.
(Its life decided by its clients, ``linger_s`` > 0: test_gateway_linger.py.)"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from gateway_harness import GatewayProcess, Lab, pid_running, segments_of, wait_for_exit

from kvharbor.config import load_config
from kvharbor.gateway import embedded
from kvharbor.gateway.client import GatewayError, GatewayNotRunning, GatewayUnavailable

pytestmark = pytest.mark.timeout(90)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_two_racing_clients_start_exactly_one_gateway_that_dies_with_its_starter(lab: Lab, tmp_path: Path) -> None:
    """linger_s 0 keeps the old behaviour: the gateway stops with the engine that started it."""
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.1},
        # A file tier: its own fields (path) must reach the child's config.
        {"name": "local", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 0.1, "fsync": False},
    ]
    config_path = lab.config(mode="embedded", tiers=tiers, linger_s=0)
    config = load_config(config_path, environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    workers = [lab.worker("embedded", str(config_path)) for _ in range(2)]
    said = {worker: worker.line().split() for worker in workers}
    gateway_pids = {int(pid) for pid, _ in said.values()}
    assert len(gateway_pids) == 1, "both attached to one gateway"
    gateway_pid = gateway_pids.pop()
    lab.detached.add(gateway_pid)
    starters = [w for w in workers if said[w][1] == "started"]
    assert len(starters) == 1, "one of the two started it"
    starter, other = starters[0], next(w for w in workers if w is not starters[0])
    assert parent_of(gateway_pid) != starter.process.pid, "not as its child: vLLM's shutdown kills those"
    assert len(segments_of(config)) == 1
    assert (tmp_path / "files").is_dir(), "the child opened the file tier"

    starter.kill()  # However the engine dies (here SIGKILL), the gateway follows it.
    wait_for_exit(gateway_pid)
    assert not pid_running(gateway_pid)
    # It stopped cleanly: no segment or socket left behind.
    assert segments_of(config) == []
    assert not Path(config.gateway.socket).exists()
    # The other engine's client degrades; it does not start a gateway of its own.
    code, out, err = other.finish()
    assert code == 0, err
    assert out.strip() == "gateway-error GatewayUnavailable"


def test_a_forked_child_does_not_keep_the_gateway_alive(lab: Lab) -> None:
    config_path = lab.config(mode="embedded", linger_s=0)
    config = load_config(config_path, environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    starter = lab.worker("embedded", str(config_path), "fork")
    gateway_pid = int(starter.line().split()[0])
    lab.detached.add(gateway_pid)
    child_pid = int(starter.line())
    assert parent_of(child_pid) == starter.process.pid
    try:
        starter.kill()  # Its forked child runs on, holding copies of its file descriptors...
        wait_for_exit(gateway_pid)  # ...but not the gateway's lifeline.
        assert pid_running(child_pid)
        assert segments_of(config) == []
    finally:
        os.kill(child_pid, signal.SIGTERM)
        wait_for_exit(child_pid)


def test_service_mode_starts_nothing(lab: Lab) -> None:
    config = load_config(lab.config(mode="service"), environ={})
    with pytest.raises(GatewayNotRunning, match="no gateway answers"):
        embedded.connect(config, "engine")
    assert segments_of(config) == []


def test_an_unusable_gateway_is_reported_not_replaced(started: Callable[..., GatewayProcess]) -> None:
    """A gateway that answers but whose segment this process cannot open: starting a
    second one would not help (and could not take the socket); say why instead."""
    gateway = started(mode="embedded")
    for path in segments_of(gateway.config):
        path.unlink()
    with pytest.raises(GatewayUnavailable, match="--ipc=host"):
        embedded.connect(gateway.config, "engine")
    assert gateway.process is not None and gateway.process.poll() is None


def test_a_child_that_cannot_start_is_explained(lab: Lab, tmp_path: Path) -> None:
    config = load_config(lab.config(mode="embedded", shm_dir=str(tmp_path / "no-such-dir")), environ={})
    with pytest.raises(GatewayError, match=r"exited before it was ready .*its log .* says why:\n.*no-such-dir"):
        embedded.connect(config, "engine")
