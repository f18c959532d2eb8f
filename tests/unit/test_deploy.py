"""The deployment examples in docs/deploy work as written: the systemd unit passes
``systemd-analyze verify`` and runs a command line the real ``kvharbor`` parser takes;
the Kubernetes manifest loads, its kvharbor config validates, its command lines parse
with the real ``kvharbor`` and vLLM parsers, and the volumes and probes it relies on
are the ones the config names."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from kvharbor.cli import build_parser
from kvharbor.config import Config, FileTierSection, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy"
UNIT = DEPLOY / "kvharbor-gateway.service"
MANIFEST = DEPLOY / "kubernetes-sidecar.yaml"


# -- systemd -------------------------------------------------------------------


def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as sections of (key, value) in order (keys may repeat, as
    ``Environment=`` does; configparser would refuse that)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, equals, value = line.partition("=")
        assert equals and current is not None and key.strip().isidentifier(), f"line {number}: {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def test_the_unit_runs_a_service_mode_gateway_with_flags_the_cli_takes(tmp_path: Path) -> None:
    sections = unit_sections(UNIT.read_text())
    assert set(sections) == {"Unit", "Service", "Install"}
    service = dict(sections["Service"])  # The last of a repeated key, except where gathered below.
    assert service["Type"] == "simple" and service["KillSignal"] == "SIGTERM"
    assert dict(sections["Install"])["WantedBy"] == "multi-user.target"
    binary, *argv = shlex.split(service["ExecStart"])
    assert PurePosixPath(binary).name == "kvharbor"
    args = build_parser().parse_args(argv)
    assert args.command == "gateway" and args.start_clean is False
    # The environment it sets is valid config, and makes it a service on its runtime directory.
    environ = dict(value.split("=", 1) for key, value in sections["Service"] if key == "Environment")
    assert all(name.startswith("KVHARBOR__") for name in environ)
    config = load_config(None, environ=environ)
    assert config.gateway.mode == "service"
    assert PurePosixPath(config.gateway.socket).parent == PurePosixPath("/run") / service["RuntimeDirectory"]
    assert config.gateway.socket in service["ExecStartPost"]
    assert service["PrivateIPC"] == "false" and service["PrivateTmp"] == "false"  # /dev/shm is the engines'.


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, (
        "systemd-analyze is not installed: scripts/setup.sh installs it as root (apt-get install systemd)"
    )
    # The unit's ExecStart must exist to verify: point it at this environment's kvharbor.
    kvharbor = Path(sys.executable).parent / "kvharbor"
    assert kvharbor.exists(), kvharbor
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/kvharbor/bin/kvharbor", str(kvharbor)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert UNIT.name not in result.stderr, result.stderr  # No warning about the unit itself.


# -- Kubernetes ------------------------------------------------------------------


def manifest() -> tuple[dict[str, Any], dict[str, Any]]:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"ConfigMap", "Pod"}
    return kinds["ConfigMap"], kinds["Pod"]


def pod_config(config_map: dict[str, Any], container: dict[str, Any], directory: Path) -> Config:
    """The config a container sees: the ConfigMap's file and its KVHARBOR__ variables (a
    secret's value stands in as a literal)."""
    environ = {e["name"]: e.get("value", "secret-value") for e in container.get("env", []) if "__" in e["name"]}
    path = directory / f"{container['name']}.yaml"
    path.write_text(config_map["data"]["kvharbor.yaml"])
    return load_config(path, environ=environ)


def mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def test_the_sidecar_shares_shm_and_the_socket_and_is_probed_on_readyz(tmp_path: Path) -> None:
    config_map, pod = manifest()
    spec = pod["spec"]
    (gateway,) = spec["initContainers"]
    (engine,) = spec["containers"]
    assert gateway["restartPolicy"] == "Always"  # A native sidecar.
    volumes = {v["name"]: v for v in spec["volumes"]}
    config = pod_config(config_map, gateway, tmp_path)
    assert config.gateway.mode == "service"
    assert config.dashboard.auth_token == "secret-value"  # A non-loopback bind has its token.

    # The gateway's command line, parsed by the real CLI, names the mounted config.
    args = build_parser().parse_args(gateway["command"][1:])
    assert gateway["command"][0] == "kvharbor" and args.command == "gateway"
    config_dir = str(PurePosixPath(args.config).parent)
    assert mounts(gateway)[config_dir] == mounts(engine)[config_dir] == "kvharbor-config"
    assert volumes["kvharbor-config"]["configMap"]["name"] == config_map["metadata"]["name"]

    # /dev/shm and the socket directory: the same emptyDir volumes in both containers.
    shm, socket_dir = config.gateway.shm_dir, str(PurePosixPath(config.gateway.socket).parent)
    for path in (shm, socket_dir):
        name = mounts(gateway)[path]
        assert mounts(engine)[path] == name and "emptyDir" in volumes[name], path
    assert volumes[mounts(gateway)[shm]]["emptyDir"]["medium"] == "Memory"

    # The file tier is on a volume that outlives the pod, mounted in the gateway only.
    (file_tier,) = [t for t in config.storage.tiers if isinstance(t, FileTierSection)]
    assert "persistentVolumeClaim" in volumes[mounts(gateway)[file_tier.path]]
    assert file_tier.path not in mounts(engine)

    # Probes: /readyz and /healthz on the dashboard's port, metrics on the Prometheus port.
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"dashboard": config.dashboard.port, "metrics": config.telemetry.prometheus.port}
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        assert gateway[probe]["httpGet"] == {"path": path, "port": "dashboard"}, probe


def test_the_engine_command_parses_with_vllms_own_parser_and_names_our_connector(tmp_path: Path) -> None:
    config_map, pod = manifest()
    (engine,) = pod["spec"]["containers"]
    command = engine["command"]
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert args.kv_transfer_config.kv_connector == transfer["kv_connector"] == "KVHarborConnector"
    assert args.enable_prompt_tokens_details is True
    __import__(transfer["kv_connector_module_path"])  # The module vLLM will load exists.
    assert transfer["kv_connector_extra_config"]["config_file"].startswith("/etc/kvharbor/")
    assert pod_config(config_map, engine, tmp_path).gateway.mode == "service"  # The engine never starts a gateway.
