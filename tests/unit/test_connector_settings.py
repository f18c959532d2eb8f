"""The connector's config from ``kv_connector_extra_config``: merged with the file and environment, refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvharbor.config import ConfigError
from kvharbor.connector.vllm.settings import config_from_extra


def test_no_extra_config_gives_the_defaults() -> None:
    config = config_from_extra(None, environ={})
    assert config.engine.chunk_size == 256
    assert config.gateway.mode == "embedded"


def test_sections_merge_over_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "kvharbor.yaml"
    path.write_text("engine: {chunk_size: 512, key_namespace: from-file}\ngateway: {shm_name: filed}\n")
    environ = {"KVHARBOR__ENGINE__KEY_NAMESPACE": "from-env"}
    config = config_from_extra({"config_file": str(path), "engine": {"chunk_size": 1024}}, environ=environ)
    assert config.engine.chunk_size == 1024  # extra config wins
    assert config.engine.key_namespace == "from-env"  # environment over the file
    assert config.gateway.shm_name == "filed"


def test_the_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "kvharbor.yaml"
    path.write_text("engine: {require_cache_salt: true}\n")
    assert config_from_extra({}, environ={"KVHARBOR_CONFIG": str(path)}).engine.require_cache_salt


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"chunk_sise": 512}, "unknown key(s) chunk_sise"),
        ({"engine": {"chunk_sise": 512}}, "engine.chunk_sise"),
        ({"engine": {"chunk_size": "big"}}, "engine.chunk_size"),
        ({"engine": {"chunk_size": -256}}, "engine.chunk_size"),
        ({"engine": {"require_cache_salt": "perhaps"}}, "engine.require_cache_salt"),
        ({"gateway": {"mode": "sidecar"}}, "gateway.mode"),
        ({"storage": {"tiers": [{"name": "x", "type": "tape", "capacity_gb": 1}]}}, "unknown tier type 'tape'"),
        ({"config_file": 42}, "kv_connector_extra_config.config_file"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(extra: dict, named: str) -> None:
    with pytest.raises(ConfigError) as refusal:
        config_from_extra(extra, environ={})
    assert named in str(refusal.value)


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError, match=r"nowhere\.yaml does not exist"):
        config_from_extra({"config_file": str(missing)}, environ={})
