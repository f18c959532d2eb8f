"""A gateway serves only engines that share its storage and card config.

Two engines of two configs at once get two gateways when ``gateway.socket`` is
left ``derived``; on one explicit socket, the second is refused with
``CONFIG_MISMATCH``, naming what differs and how to fix it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from gateway_harness import GatewayProcess, Lab, closing_client, keys_of, segments_of, wait_for_exit

from kvharbor.config import Config, gateway_address, load_config
from kvharbor.gateway import embedded
from kvharbor.gateway.client import ConfigMismatch, GatewayClient
from kvharbor.hal.file import FileDevice

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short XDG_RUNTIME_DIR of its own, where derived sockets go (a socket path holds 107 bytes),
    for this process and the workers it starts."""
    with tempfile.TemporaryDirectory(prefix="kvh-rt-", dir="/tmp") as directory:
        monkeypatch.setenv("XDG_RUNTIME_DIR", directory)
        yield Path(directory)


def derived_config(directory: Path, files: Path) -> Path:
    """An embedded-mode config that names no socket or shm_name: both derived from its tiers."""
    directory.mkdir(parents=True)
    document = {
        # linger_s 0: each gateway goes with its engine, so the test sees one go while the other serves.
        "gateway": {"mode": "embedded", "ring_mb": 16, "ring_mb_min": 1, "shm_reserve_mb": 0, "linger_s": 0},
        "storage": {"tiers": [{"name": "local", "type": "file", "path": str(files), "capacity_gb": 0.1,
                               "fsync": False}]},
    }  # fmt: skip
    path = directory / "kvharbor.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def stored_keys(files: Path) -> set[bytes]:
    return {key for key, _ in FileDevice("local", str(files), 64 << 20).scan()}


def test_two_configs_at_once_get_two_gateways_each_with_its_own_tiers(
    lab: Lab, tmp_path: Path, runtime_dir: Path
) -> None:
    files = {tag: tmp_path / f"files-{tag}" for tag in (1, 2)}
    paths = {tag: derived_config(tmp_path / f"engine-{tag}", files[tag]) for tag in (1, 2)}
    configs: dict[int, Config] = {}
    for tag, path in paths.items():
        configs[tag] = load_config(path, environ={})
        lab.shm.add((Path(configs[tag].gateway.shm_dir), configs[tag].gateway.shm_name))
    workers = {tag: lab.worker("embedded-store", str(paths[tag]), str(tag), "3") for tag in (1, 2)}
    said = {tag: worker.line().split() for tag, worker in workers.items()}

    gateway_pids = {tag: int(words[0]) for tag, words in said.items()}
    assert gateway_pids[1] != gateway_pids[2], "each config started a gateway of its own"
    for tag, (_, socket, _, stored) in said.items():
        assert Path(socket) == gateway_address(configs[tag]).socket, "at the address gateway_address gives"
        assert Path(socket).parent == runtime_dir / "kvharbor"
        assert stored == "3"
        assert len(segments_of(configs[tag])) == 1
    # Each engine's chunks are in its own tier and nowhere else.
    assert stored_keys(files[1]) == set(keys_of(3, 1))
    assert stored_keys(files[2]) == set(keys_of(3, 2))

    workers[1].kill()  # The first engine goes, and its gateway with it...
    wait_for_exit(gateway_pids[1])
    code, out, err = workers[2].finish()  # ...while the second one's cache stays on.
    assert code == 0, err
    assert out.strip() == "holds 3"


def beside(served: GatewayProcess, tmp_path: Path, **changes: object) -> Config:
    """A config on the same explicit socket as ``served``'s, with sections changed."""
    document = yaml.safe_load(served.config_path.read_text())
    document.update(changes)
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(document))
    return load_config(path, environ={})


def test_another_config_on_an_explicit_socket_is_refused_naming_what_differs(
    started: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gateway = started(mode="embedded")
    socket = gateway.config.gateway.socket
    bigger_ram = beside(gateway, tmp_path, storage={"tiers": [{"name": "ram", "type": "ram", "capacity_gb": 0.5}]})
    with pytest.raises(ConfigMismatch) as caught:
        GatewayClient.connect(bigger_ram.gateway, "second-engine")
    message = str(caught.value)
    assert message.startswith("CONFIG_MISMATCH")
    assert "its storage section differs" in message and socket in message
    assert bigger_ram.gateway.config_digest.short in message and gateway.config.gateway.config_digest.short in message
    assert "gateway.socket" in message and "derived" in message, "says how to fix it"

    other_card = beside(gateway, tmp_path, card={"fragment_bytes": 8192})
    # Embedded mode does not start a second gateway for it: nothing could take the socket.
    with pytest.raises(ConfigMismatch, match="its card section differs"):
        embedded.connect(other_card, "third-engine")
    assert len(segments_of(gateway.config)) == 1

    with closing_client(gateway.client("same-config")) as client:  # The gateway serves its own config on.
        assert client.lookup(keys_of(1)) == 0
        status = client.status()
        assert status.rejected == {"CONFIG_MISMATCH": 2}
        assert status.config_digest == gateway.config.gateway.config_digest.short
    assert gateway.log().count("CONFIG_MISMATCH") == 2


def test_engine_and_gateway_sections_may_differ(started: Callable[..., GatewayProcess], tmp_path: Path) -> None:
    """Only storage and card must match: another chunk size or client timeout shares the gateway."""
    gateway = started()
    gateway_section = {**gateway.config.gateway.model_dump(mode="json"), "request_timeout_ms": 7000}
    for config in (
        beside(gateway, tmp_path, engine={"chunk_size": 512}),
        beside(gateway, tmp_path, gateway=gateway_section),
    ):
        with closing_client(GatewayClient.connect(config.gateway, "engine")) as client:
            assert client.hello.gateway_pid == gateway.pid
