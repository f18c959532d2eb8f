"""An embedded gateway whose clients decide its life (``gateway.linger_s``): it outlives
the engine that started it, however that engine is killed, serves the next one from its
RAM tier, and ends by itself once idle for ``linger_s``."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from gateway_harness import (
    FINGERPRINT,
    VALUE_BYTES,
    WAIT_S,
    Lab,
    closing_client,
    get_values,
    keys_of,
    pid_running,
    segments_of,
    value_for,
    wait_for_exit,
    wait_until,
)

from kvharbor.config import Config, load_config
from kvharbor.gateway import embedded
from kvharbor.gateway.client import GatewayClient, GatewaySteppingAside, VersionMismatch
from kvharbor.gateway.detach import log_path

pytestmark = pytest.mark.timeout(90)

RAM_ONLY = [{"name": "ram", "type": "ram", "capacity_gb": 0.1}]
"""No persistent tier: a hit after the starter's death can only come from the RAM tier."""
STORED = 4


def embedded_config(lab: Lab, **gateway: object) -> Config:
    config = load_config(lab.config(mode="embedded", tiers=RAM_ONLY, **gateway), environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    return config


def config_file(config: Config) -> str:
    """The file `Lab.config` wrote ``config`` to (beside its socket)."""
    return str(Path(config.gateway.socket).with_name("kvharbor.yaml"))


def gateway_log(config: Config) -> str:
    path = log_path(Path(config.gateway.socket))
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_log(config: Config, line: str, count: int = 1) -> None:
    wait_until(lambda: gateway_log(config).count(line) >= count, f"{line!r} in the gateway's log")


def start_storing(lab: Lab, config: Config) -> tuple[int, int]:
    """A worker starts the gateway and stores `STORED` values: (gateway pid, worker pid)."""
    starter = lab.worker("embedded", config_file(config), "put", str(STORED))
    pid, role = starter.line().split()
    assert role == "started"
    lab.detached.add(int(pid))
    assert starter.line() == "stored"
    return int(pid), starter.process.pid


def kill_tree_as_vllm_does(pid: int) -> list[int]:
    """vLLM's `kill_process_tree`: SIGKILL to every descendant (psutil, recursive), then to ``pid``."""
    parent = psutil.Process(pid)
    descendants = [child.pid for child in parent.children(recursive=True)]
    for child in descendants:
        os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    wait_for_exit(pid)
    return descendants


@pytest.mark.parametrize("how", ["starter", "tree"])
def test_the_gateway_outlives_its_starter_and_serves_the_next_engine_from_ram(lab: Lab, how: str) -> None:
    config = embedded_config(lab)  # The default linger_s, 600 s.
    gateway_pid, starter_pid = start_storing(lab, config)
    if how == "tree":
        assert gateway_pid not in kill_tree_as_vllm_does(starter_pid), "the gateway is no descendant of its engine"
    else:
        os.kill(starter_pid, signal.SIGKILL)
    wait_for_log(config, "kvharbor: last client detached; lingering 600 s")
    assert pid_running(gateway_pid)
    assert len(segments_of(config)) == 1

    # The next engine attaches to the same gateway and restores from its RAM tier.
    started_before = embedded.started_here()  # Earlier tests in this process may have started some.
    with closing_client(embedded.connect(config, "next-engine")) as client:
        assert client.hello.gateway_pid == gateway_pid
        assert embedded.started_here() == started_before, "attached, not started"
        keys = keys_of(STORED)
        assert client.lookup(keys) == STORED
        assert get_values(client, keys) == [value_for(key, VALUE_BYTES) for key in keys]
        wait_for_log(config, "kvharbor: a client attached to a lingering gateway")
    # Its detach starts the countdown again; the log says each transition once.
    wait_for_log(config, "kvharbor: last client detached; lingering", count=2)
    assert gateway_log(config).count("a client attached to a lingering gateway") == 1


def test_an_idle_gateway_ends_by_itself_and_removes_its_segment_and_socket(lab: Lab) -> None:
    config = embedded_config(lab, linger_s=1)
    gateway_pid, starter_pid = start_storing(lab, config)
    os.kill(starter_pid, signal.SIGKILL)
    wait_for_exit(gateway_pid)
    log = gateway_log(config)
    assert "kvharbor: last client detached; lingering 1 s" in log
    assert "kvharbor: embedded gateway idle for 1 s (gateway.linger_s); stopping" in log
    assert "kvharbor: gateway stopped" in log
    assert segments_of(config) == []
    assert not Path(config.gateway.socket).exists()


def test_a_gateway_that_never_gets_a_client_ends_too(lab: Lab) -> None:
    """Started the way an engine starts it (the intermediate forks it and exits), then nobody comes."""
    config_path = lab.config(mode="embedded", tiers=RAM_ONLY, linger_s=1)
    config = load_config(config_path, environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    read_end, write_end = os.pipe()
    command = [sys.executable, "-m", "kvharbor", "gateway", "--config", str(config_path), "--embedded",
               "--ready-fd", str(write_end)]  # fmt: skip
    intermediate = subprocess.Popen(command, pass_fds=(write_end,), stdin=subprocess.DEVNULL)
    os.close(write_end)
    answer = b""
    try:
        while select.select([read_end], [], [], WAIT_S)[0] and (chunk := os.read(read_end, 64)):
            answer += chunk
    finally:
        os.close(read_end)
    assert intermediate.wait(WAIT_S) == 0, "the intermediate exits once it forked the gateway"
    pid_line, ready = answer.decode().splitlines()
    gateway_pid = int(pid_line.removeprefix("pid "))
    lab.detached.add(gateway_pid)
    assert ready == "ready"
    assert pid_running(gateway_pid)
    assert gateway_pid not in [p.pid for p in psutil.Process().children(recursive=True)], "no descendant of ours"
    wait_for_exit(gateway_pid)
    assert "idle for 1 s (gateway.linger_s); stopping" in gateway_log(config)
    assert segments_of(config) == []
    assert not Path(config.gateway.socket).exists()


def test_a_put_in_flight_when_the_last_client_dies_is_committed(lab: Lab) -> None:
    config = embedded_config(lab)
    worker = lab.worker("embedded", config_file(config), "commit-and-die", "8")
    gateway_pid = int(worker.line().split()[0])
    lab.detached.add(gateway_pid)
    assert worker.line() == "committing"
    worker.kill()  # Its commit is sent; it never reads the answer.
    wait_for_log(config, "kvharbor: last client detached; lingering")
    with closing_client(GatewayClient.connect(config.gateway, "next-engine")) as client:
        keys = keys_of(8)
        assert client.lookup(keys) == 8
        assert get_values(client, keys) == [value_for(key, VALUE_BYTES) for key in keys]


def test_an_idle_gateway_of_another_release_steps_aside(lab: Lab) -> None:
    config = embedded_config(lab)
    gateway_pid, starter_pid = start_storing(lab, config)
    # Busy (the starter and this client attached): it refuses, saying how to clear it.
    busy = r"serves 2 client\(s\) of its release and steps aside once"
    with closing_client(GatewayClient.connect(config.gateway, "same")), pytest.raises(VersionMismatch, match=busy):
        GatewayClient.connect(config.gateway, "new-engine", release="9.9.9")
    os.kill(starter_pid, signal.SIGKILL)
    wait_for_log(config, "kvharbor: last client detached; lingering")
    # Idle: it steps aside, and tells the new client which process to wait for.
    with pytest.raises(GatewaySteppingAside, match=r"VERSION_MISMATCH.*9\.9\.9.*steps aside") as caught:
        GatewayClient.connect(config.gateway, "new-engine", release="9.9.9")
    assert caught.value.gateway_pid == gateway_pid
    wait_for_exit(gateway_pid)
    assert segments_of(config) == []
    assert not Path(config.gateway.socket).exists()
    # A new engine of that release would now start its own: with ours, embedded.connect does.
    with closing_client(embedded.connect(config, "new-engine")) as client:
        lab.detached.add(client.hello.gateway_pid)
        assert client.hello.gateway_pid in embedded.started_here()
        assert client.lookup(keys_of(STORED)) == 0, "the RAM tier went with the old gateway"


def test_a_lingering_gateway_whose_segment_was_removed_steps_aside_for_the_next_engine(lab: Lab) -> None:
    config = embedded_config(lab)
    gateway_pid, starter_pid = start_storing(lab, config)
    os.kill(starter_pid, signal.SIGKILL)
    wait_for_log(config, "kvharbor: last client detached; lingering")
    for path in segments_of(config):
        path.unlink()  # By hand.
    with closing_client(embedded.connect(config, "next-engine")) as client:
        lab.detached.add(client.hello.gateway_pid)
        assert client.hello.gateway_pid != gateway_pid
        assert client.hello.gateway_pid in embedded.started_here()
        assert not pid_running(gateway_pid)
        assert client.lookup([FINGERPRINT]) == 0  # The new gateway serves.
