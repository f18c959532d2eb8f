"""The config: defaults, YAML, environment overrides, and refusals that name the key."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvharbor.config import (
    TIER_TYPES,
    ConfigError,
    FileTierSection,
    RamTierSection,
    gateway_address,
    load_config,
    validate_config,
)
from kvharbor.hal.registry import device_types


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvharbor.yaml"
    path.write_text(text)
    return path


def test_the_defaults_are_a_valid_config() -> None:
    config = load_config(environ={})
    assert config.engine.chunk_size == 256
    assert config.engine.key_namespace == "default"
    assert config.gateway.mode == "embedded"
    assert config.gateway.ring_mb >= config.gateway.ring_mb_min
    assert [(t.name, t.type) for t in config.storage.tiers] == [("ram", "ram"), ("local", "file")]
    assert config.storage.backpressure.circuit_breaker.failure_ratio == 0.2
    assert config.card.fragment_bytes == 2 * 1024 * 1024


def test_a_yaml_file_is_loaded(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
engine:
  chunk_size: 128
  key_namespace: team-a
storage:
  write_policy: write_back
  tiers:
    - {name: hot, type: ram, capacity_gb: 2}
    - {name: disk, type: file, path: /var/cache/kv, capacity_gb: 50, codec: zstd}
  backpressure:
    circuit_breaker: {failure_ratio: 0.5, window: 20, cooldown_s: 5}
""",
    )
    config = load_config(path, environ={})
    assert (config.engine.chunk_size, config.engine.key_namespace) == (128, "team-a")
    hot, disk = config.storage.tiers
    assert isinstance(hot, RamTierSection) and hot.capacity_bytes == 2 << 30
    assert isinstance(disk, FileTierSection) and (disk.path, disk.codec) == ("/var/cache/kv", "zstd")
    assert config.storage.write_policy == "write_back"
    assert config.storage.backpressure.circuit_breaker.window == 20
    assert config.gateway.ring_mb == 1024  # Untouched sections keep their defaults.


def test_the_file_can_be_named_by_environment(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "engine: {chunk_size: 64}\n")
    assert load_config(environ={"KVHARBOR_CONFIG": str(path)}).engine.chunk_size == 64


def test_an_environment_override_wins_over_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "engine: {chunk_size: 128, require_cache_salt: false}\n")
    environ = {
        "KVHARBOR__ENGINE__CHUNK_SIZE": "512",
        "KVHARBOR__ENGINE__REQUIRE_CACHE_SALT": "true",
        "KVHARBOR__DASHBOARD__AUTH_TOKEN": "s3cret",
    }
    config = load_config(path, environ=environ)
    assert config.engine.chunk_size == 512
    assert config.engine.require_cache_salt is True
    assert config.dashboard.auth_token == "s3cret"


def _tiers(*tiers: dict[str, Any]) -> dict[str, Any]:
    return {"storage": {"tiers": list(tiers)}}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        pytest.param(
            _tiers({"name": "t", "type": "tape", "capacity_gb": 1}),
            ["storage.tiers", "unknown tier type 'tape'", "ram", "file"],
            id="unknown tier type",
        ),
        pytest.param(
            _tiers({"name": "ram", "type": "ram", "capacity_gb": -1}),
            ["storage.tiers", "tiers[0]", "capacity_gb", "greater than 0"],
            id="negative capacity",
        ),
        pytest.param({"engine": {"chunk_sise": 256}}, ["engine.chunk_sise", "not permitted"], id="unknown key"),
        pytest.param({"engine": {"chunk_size": "big"}}, ["engine.chunk_size", "'big'"], id="wrong type"),
        pytest.param({"gateway": {"mode": "sidecar"}}, ["gateway.mode", "'sidecar'"], id="bad choice"),
        pytest.param({"engine": {"verify_wait_ms": -1}}, ["engine.verify_wait_ms", "greater than"], id="negative wait"),
        pytest.param({"engine": {"load_batch_mb": 0}}, ["engine.load_batch_mb", "greater than 0"], id="no load batch"),
        pytest.param(
            {"engine": {"save_staging_wait_ms": -1}},
            ["engine.save_staging_wait_ms", "greater than or equal to 0"],
            id="negative staging wait",
        ),
        pytest.param(
            {"engine": {"load_start_wait_ms": "nan"}}, ["engine.load_start_wait_ms", "finite"], id="nan start wait"
        ),
        pytest.param(
            {"engine": {"loads_in_flight_max": 0}},
            ["engine.loads_in_flight_max", "greater than 0"],
            id="no load in flight",
        ),
        pytest.param(
            {"engine": {"load_layered_mb": -1}},
            ["engine.load_layered_mb", "greater than or equal to 0"],
            id="negative layered load",
        ),
        pytest.param(
            _tiers(
                {"name": "ram", "type": "ram", "capacity_gb": 1},
                {"name": "ram", "type": "file", "path": "/x", "capacity_gb": 1},
            ),
            ["storage.tiers", "unique", "ram"],
            id="duplicate tier names",
        ),
        # A file tier without path is not refused: it is skipped naming it (tests/unit/test_tier_config.py).
        pytest.param({"gateway": {"linger_s": -1}}, ["gateway.linger_s", "greater than or equal"], id="linger < 0"),
        pytest.param({"gateway": {"linger_s": "abc"}}, ["gateway.linger_s", "'abc'"], id="linger not a number"),
        pytest.param({"gateway": {"linger_s": "nan"}}, ["gateway.linger_s", "finite"], id="linger nan"),
        pytest.param(
            {"engine": {"load_resample_s": 600, "load_resample_max_s": 60}},
            ["engine.load_resample_max_s", "engine.load_resample_s"],
            id="resample max below its start",
        ),
        pytest.param(
            {"gateway": {"request_max_ms": 500, "progress_interval_ms": 500, "request_timeout_ms": 1000}},
            ["gateway.request_max_ms", "gateway.progress_interval_ms"],
            id="request max not above the progress interval",
        ),
        pytest.param({"gateway": {"cpus": [0, 0]}}, ["gateway.cpus", "names a CPU twice"], id="a CPU twice"),
        pytest.param({"gateway": {"cpus": [-1]}}, ["gateway.cpus", "greater than or equal to 0"], id="CPU < 0"),
        pytest.param({"gateway": {"cpus": []}}, ["gateway.cpus", "at least 1"], id="no CPUs"),
        pytest.param(
            {"storage": {"refill_ram_mb_per_s": 0}},
            ["storage.refill_ram_mb_per_s", "greater than 0"],
            id="refill pace 0",
        ),
        pytest.param(
            {"storage": {"refill_ram": "sometimes"}}, ["storage.refill_ram", "'sometimes'"], id="refill not a bool"
        ),
        pytest.param({"sglang": {"copy_threads": 0}}, ["sglang.copy_threads", "greater than 0"], id="no copy thread"),
        pytest.param(
            {"gateway": {"ring_mb": 32, "ring_mb_min": 64}},
            ["gateway.ring_mb", "gateway.ring_mb_min"],
            id="ring below its minimum",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_the_key(data: dict[str, Any], named: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    message = str(caught.value)
    for part in named:
        assert part in message


def test_a_bad_environment_override_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.ring_mb: .*'lots'"):
        load_config(environ={"KVHARBOR__GATEWAY__RING_MB": "lots"})


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"{missing} does not exist"):
        load_config(missing, environ={})


def test_invalid_yaml_is_named(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "engine: {chunk_size: 256\n")
    with pytest.raises(ConfigError, match=f"{path} is not valid YAML"):
        load_config(path, environ={})


def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(path, environ={})


def test_a_config_error_is_a_value_error() -> None:
    # The CLI turns ValueError into "kvharbor: error: ..." and exit status 2.
    assert issubclass(ConfigError, ValueError)


def test_config_and_hal_registry_know_the_same_tier_types() -> None:
    assert sorted(TIER_TYPES) == device_types()


def test_a_socket_path_too_long_to_bind_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.socket: .* a Unix socket path holds at most 107"):
        validate_config({"gateway": {"socket": "/tmp/" + "d" * 120 + "/gw.sock"}})


# -- which gateway a config uses (gateway_address) ---------------------------

FILES = {"tiers": [{"name": "local", "type": "file", "path": "/var/cache/a", "capacity_gb": 1}]}


def test_the_digest_covers_storage_and_card_but_not_engine_or_gateway() -> None:
    base = validate_config({"storage": FILES})
    same = validate_config(
        {"storage": FILES, "engine": {"chunk_size": 512}, "gateway": {"ring_mb": 128, "request_timeout_ms": 9000}}
    )
    assert same.gateway.config_digest == base.gateway.config_digest
    assert gateway_address(same) == gateway_address(base), "one gateway serves both"
    other_path = validate_config({"storage": {"tiers": [{**FILES["tiers"][0], "path": "/var/cache/b"}]}})
    other_card = validate_config({"storage": FILES, "card": {"fragment_bytes": 4096}})
    assert other_path.gateway.config_digest.differing(base.gateway.config_digest) == ["storage"]
    assert other_card.gateway.config_digest.differing(base.gateway.config_digest) == ["card"]
    spelt_out = validate_config({"storage": FILES, "card": {"key_eviction": True, "fragment_bytes": 2 << 20}})
    assert spelt_out.gateway.config_digest == base.gateway.config_digest, "defaults count as written"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose socket paths fit in sockaddr_un (pytest's tmp_path may be too deep)."""
    path = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_derived_gateway_is_the_configs_own_and_an_explicit_one_is_kept(
    monkeypatch: pytest.MonkeyPatch, short_dir: Path
) -> None:
    tmp_path = short_dir
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    first = gateway_address(validate_config({"storage": FILES}))
    second = gateway_address(validate_config({"storage": {**FILES, "write_policy": "write_back"}}))
    assert first.socket.parent == second.socket.parent == tmp_path / "kvharbor"
    assert first.socket != second.socket and first.shm_name != second.shm_name
    assert first.socket.name == f"gateway-{first.config_digest.short}.sock"
    assert first.shm_name == f"kvharbor-{first.config_digest.short}"
    explicit = validate_config({"storage": FILES, "gateway": {"socket": "/run/kv/gw.sock", "shm_name": "kv"}})
    assert (gateway_address(explicit).socket, gateway_address(explicit).shm_name) == (Path("/run/kv/gw.sock"), "kv")
    assert explicit.gateway.config_digest == first.config_digest
    # "derived" spelt out is the default; the resolved config survives the embedded child's round trip.
    spelt = validate_config({"storage": FILES, "gateway": {"socket": "derived", "shm_name": "derived"}})
    assert gateway_address(spelt) == first
    assert validate_config(spelt.model_dump(mode="json", serialize_as_any=True)) == spelt
    # Without a runtime directory, a directory of the user's own in /tmp.
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert gateway_address(validate_config({"storage": FILES})).socket.parent == Path(f"/tmp/kvharbor-{os.geteuid()}")


def test_access_names_that_do_not_exist_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.access\.group: no group named 'no-such-group-kvh'"):
        validate_config({"gateway": {"access": {"group": "no-such-group-kvh"}}})
    with pytest.raises(ConfigError, match=r"gateway\.access\.users: no user named 'no-such-user-kvh'"):
        validate_config({"gateway": {"access": {"users": ["root", "no-such-user-kvh"]}}})
    with pytest.raises(ConfigError, match=r"gateway\.access\.users: user id -1 is negative"):
        validate_config({"gateway": {"access": {"users": [-1]}}})
    with pytest.raises(ConfigError, match=r"gateway\.access\.grop"):
        validate_config({"gateway": {"access": {"grop": "root"}}})
    access = validate_config({"gateway": {"access": {"group": "root", "users": ["root", 4242]}}}).gateway.access
    assert (access.gid, access.uids, access.widened) == (0, frozenset({0, 4242}), True)
    assert not validate_config({}).gateway.access.widened, "owner-only by default"


def test_every_config_block_of_the_readme_is_a_valid_config() -> None:
    """The README's configuration reference names real keys with accepted values."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert blocks, "the README has YAML config blocks"
    for block in blocks:
        validate_config(yaml.safe_load(block))
