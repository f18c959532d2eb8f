"""``KVHARBOR=1``: the connector is filled in only when the engine has no KV transfer config."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs

from kvharbor.connector.vllm import cpu_binding, plugin
from kvharbor.connector.vllm.settings import config_from_extra
from kvharbor.telemetry.log import OnceLog

EXAMPLE = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")


@pytest.fixture(autouse=True)
def fresh_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the plugin's one-time lines afresh."""
    monkeypatch.setattr(plugin, "_once", OnceLog(plugin._log))


@pytest.mark.parametrize("value", ["", "0", "false", "off", "no"])
def test_without_kvharbor_nothing_changes(value: str) -> None:
    assert plugin.choose_transfer_config(None, {"KVHARBOR": value}) is None
    assert plugin.choose_transfer_config(EXAMPLE, {"KVHARBOR": value}) is EXAMPLE


def test_kvharbor_fills_in_its_connector_when_none_is_given(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "kvharbor"):
        chosen = plugin.choose_transfer_config(None, {"KVHARBOR": "1"})
    assert chosen.kv_connector == "KVHarborConnector"
    assert chosen.kv_connector_module_path == "kvharbor.connector.vllm.connector"
    assert chosen.kv_role == "kv_both"
    assert chosen.kv_load_failure_policy == "recompute"  # A miss is recomputed, never a failed request.
    assert "kvharbor: KVHARBOR=1: the kvharbor KV connector is on" in caplog.text
    # Marked as filled in by the variable (what a model kvharbor cannot serve then does), and
    # the mark is no config key of kvharbor's to refuse.
    assert plugin.activated_by_env(chosen.kv_connector_extra_config)
    config_from_extra(chosen.kv_connector_extra_config, environ={})


def test_an_explicit_config_is_not_marked_as_the_variables() -> None:
    assert not plugin.activated_by_env(None)
    assert not plugin.activated_by_env({})
    assert not plugin.activated_by_env({"config_file": "/etc/kvharbor.yaml"})
    assert not plugin.activated_by_env({plugin.ACTIVATION_KEY: "someone"})


def test_an_explicit_config_wins_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "kvharbor"):
        assert plugin.choose_transfer_config(EXAMPLE, {"KVHARBOR": "1"}) is EXAMPLE
        assert plugin.choose_transfer_config({"kv_connector": "NixlConnector"}, {"KVHARBOR": "1"}) == {
            "kv_connector": "NixlConnector"
        }
    assert "explicit --kv-transfer-config (ExampleConnector) was given; it wins" in caplog.text
    assert caplog.text.count("it wins") == 1  # Said once.


def test_an_explicit_kvharbor_config_is_kept_silently(caplog: pytest.LogCaptureFixture) -> None:
    mine = KVTransferConfig(**plugin.transfer_config())
    with caplog.at_level(logging.INFO, "kvharbor"):
        assert plugin.choose_transfer_config(mine, {"KVHARBOR": "1"}) is mine
    assert "it wins" not in caplog.text


@pytest.mark.parametrize(
    ("env", "given", "expected"),
    [("1", None, "KVHarborConnector"), ("", None, None), ("1", EXAMPLE, "ExampleConnector")],
)
def test_the_wrapped_engine_args_build_the_chosen_config(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, env: str, given: KVTransferConfig | None, expected: str | None
) -> None:
    monkeypatch.setenv("KVHARBOR", "1")
    plugin.register()  # What vLLM's plugin loader runs; wraps EngineArgs.create_engine_config once.
    monkeypatch.setenv("KVHARBOR", env)
    for name in (cpu_binding.RESERVED_ENV, cpu_binding.BIND_ENV):
        monkeypatch.setenv(name, "")  # Recorded, so the plugin's setting is undone after the test,
        monkeypatch.delenv(name)  # then unset, as on a host where nobody set them.
    args = EngineArgs(model=str(tiny_model), enforce_eager=True, dtype="float32", max_model_len=4096)
    args.kv_transfer_config = given
    config = args.create_engine_config()
    chosen = config.kv_transfer_config
    assert (chosen.kv_connector if chosen is not None else None) == expected
    # On the CPU backend, kvharbor's engine reserves the cores vLLM reserves without a
    # connector (one, for one rank); other connectors' engines are left as vLLM sets them.
    reserved = os.environ.get(cpu_binding.RESERVED_ENV)
    assert reserved == ("1" if expected == "KVHarborConnector" else None)


def test_the_users_cpu_binding_wins(tiny_model: Path) -> None:
    config = EngineArgs(
        model=str(tiny_model), enforce_eager=True, dtype="float32", max_model_len=4096
    ).create_engine_config()
    environ: dict[str, str] = {}
    assert cpu_binding.keep_engine_cores(config, environ) == 1
    assert environ == {cpu_binding.RESERVED_ENV: "1"}
    for set_by_user in (
        {cpu_binding.RESERVED_ENV: "0"},
        {cpu_binding.BIND_ENV: "0-1"},
        {cpu_binding.BIND_ENV: "nobind"},
    ):
        environ = dict(set_by_user)
        assert cpu_binding.keep_engine_cores(config, environ) is None
        assert environ == set_by_user
