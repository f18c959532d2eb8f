"""The handshake: versions checked on both sides, and a segment the client cannot open
explained in terms of what to change (shared IPC namespace and /dev/shm)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from gateway_harness import GatewayProcess, Lab, closing_client

from kvharbor import __version__
from kvharbor.gateway.client import GatewayClient, GatewayUnavailable, VersionMismatch

pytestmark = pytest.mark.timeout(60)

IPC_HINT = ("IPC namespace", "--ipc=host", "hostIPC")


def test_other_release_is_refused_and_the_gateway_serves_on(started: Callable[..., GatewayProcess]) -> None:
    gateway = started()
    with pytest.raises(VersionMismatch) as caught:
        GatewayClient.connect(gateway.config.gateway, "old-engine", release="9.9.9")
    message = str(caught.value)
    assert message.startswith("VERSION_MISMATCH")
    assert "release 9.9.9" in message and f"release {__version__}" in message
    # A service-mode gateway never steps aside; it says how to clear it.
    assert f"stop this gateway (kill {gateway.pid})" in message
    with pytest.raises(VersionMismatch, match="protocol 99"):
        GatewayClient.connect(gateway.config.gateway, "odd-engine", protocol=99)
    with closing_client(gateway.client("right-engine")) as client:
        assert client.lookup([b"k" * 16]) == 0
        assert client.status().rejected == {"VERSION_MISMATCH": 2}
    log = gateway.log()
    assert "VERSION_MISMATCH" in log and "9.9.9" in log and __version__ in log


def test_segment_gone_names_the_ipc_namespace(started: Callable[..., GatewayProcess]) -> None:
    """The segment is not where HELLO_OK says (here: removed after the gateway created it)."""
    gateway = started()
    with closing_client(gateway.client()) as first:
        os.unlink(first.hello.shm_path)
    with pytest.raises(GatewayUnavailable) as caught:
        gateway.client("second")
    for hint in IPC_HINT:
        assert hint in str(caught.value)


def _unshare_works() -> bool:
    unshare = shutil.which("unshare")
    return unshare is not None and subprocess.run([unshare, "-m", "true"], capture_output=True).returncode == 0


def test_gateway_in_another_shm_namespace(lab: Lab, tmp_path: Path) -> None:
    """The real failure: the gateway runs with a /dev/shm of its own (a container without
    --ipc=host), so the path in HELLO_OK does not exist for the client. Without the
    rights to make a mount namespace, the segment is removed instead (the client sees
    the same thing: no such file)."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    config_path = lab.config(shm_dir=str(shm_dir))
    if _unshare_works():
        # A private tmpfs over shm_dir, seen by the gateway only.
        prefix = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=128m tmpfs "{shm_dir}" && exec "$@"', "sh"]
        gateway = lab.gateway(config_path, prefix=prefix).start()
        assert not list(shm_dir.iterdir()), "the segment is invisible here"
    else:
        gateway = lab.gateway(config_path).start()
        for path in shm_dir.iterdir():
            path.unlink()
    with pytest.raises(GatewayUnavailable) as caught:
        gateway.client()
    message = str(caught.value)
    for hint in IPC_HINT:
        assert hint in message
    assert str(shm_dir) in message
