"""``KVHARBOR=1`` in an SGLang launch: SGLang's real ServerArgs and plugin hook registry."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from sglang.srt.server_args import ServerArgs

from kvharbor.connector.sglang import activation
from kvharbor.connector.sglang.activation import (
    BACKEND_MODULE,
    RESOLVE_TARGET,
    STOP_TARGET,
    explicit_flags,
    fill_server_args,
)

ON = {"KVHARBOR": "1"}


def server_args(**given: Any) -> ServerArgs:
    return ServerArgs(model_path="unused", **given)


def kvharbor_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvharbor:")]


@pytest.fixture(autouse=True)
def _each_line_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines are said once per process; each test starts with none said."""
    monkeypatch.setattr(activation, "_once", activation.OnceLog(activation._log))


def test_kvharbor_becomes_the_storage_backend(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args()
    with caplog.at_level(logging.INFO, logger="kvharbor"):
        assert fill_server_args(args, ON)
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["module_path"] == BACKEND_MODULE and extra["interface_v1"] == 1
    assert extra["prefetch_threshold"] == 1
    lines = kvharbor_lines(caplog)
    assert any("prefetch_threshold set to 1 (one page" in line for line in lines)
    assert any("kvharbor is SGLang's HiCache storage backend" in line for line in lines)
    # Its own launch again (the scheduler's copy of the arguments): nothing more to do.
    assert not fill_server_args(args, ON)


def test_off_without_kvharbor_1() -> None:
    args = server_args()
    assert not fill_server_args(args, {})
    assert args.hicache_storage_backend is None and not args.enable_hierarchical_cache


def test_an_explicit_storage_backend_wins(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args(enable_hierarchical_cache=True, hicache_storage_backend="file")
    with caplog.at_level(logging.WARNING, logger="kvharbor"):
        assert not fill_server_args(args, ON)
    assert args.hicache_storage_backend == "file" and args.hicache_storage_backend_extra_config is None
    (line,) = kvharbor_lines(caplog)
    assert "an explicit --hicache-storage-backend (file) was given; it wins" in line


def test_the_users_extra_config_and_prefetch_threshold_are_kept(caplog: pytest.LogCaptureFixture) -> None:
    user = {"prefetch_threshold": 64, "config_file": "/etc/kvharbor.yaml"}
    args = server_args(hicache_storage_backend_extra_config=json.dumps(user))
    with caplog.at_level(logging.INFO, logger="kvharbor"):
        assert fill_server_args(args, ON)
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["prefetch_threshold"] == 64 and extra["config_file"] == "/etc/kvharbor.yaml"
    assert any("prefetch_threshold 64 tokens (the launch's) is in force" in line for line in kvharbor_lines(caplog))


def test_the_radix_cache_is_re_enabled_unless_forced_off(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args(disable_radix_cache=True)
    assert fill_server_args(args, ON)
    assert not args.disable_radix_cache and args.hicache_storage_backend == "dynamic"

    kept = server_args(disable_radix_cache=True)
    with caplog.at_level(logging.WARNING, logger="kvharbor"):
        assert not fill_server_args(kept, {**ON, "KVHARBOR_FORCE_RADIX": "0"})
    assert kept.disable_radix_cache and kept.hicache_storage_backend is None
    assert any("KVHARBOR_FORCE_RADIX=0; HiCache can't run without it" in line for line in kvharbor_lines(caplog))


def test_host_tier_size_from_the_environment(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args()
    assert fill_server_args(args, {**ON, "KVHARBOR_SGLANG_HOST_GB": "12"})
    assert args.hicache_size == 12
    bad = server_args()
    with caplog.at_level(logging.WARNING, logger="kvharbor"):
        assert fill_server_args(bad, {**ON, "KVHARBOR_SGLANG_HOST_GB": "lots"})
    assert bad.hicache_size == 0
    assert any("KVHARBOR_SGLANG_HOST_GB='lots' is not a whole number" in line for line in kvharbor_lines(caplog))


def test_an_unreadable_extra_config_is_named_and_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args(hicache_storage_backend_extra_config="{not json")
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        assert not fill_server_args(args, ON)
    assert args.hicache_storage_backend is None
    (line,) = kvharbor_lines(caplog)
    assert line.startswith("kvharbor: --hicache-storage-backend-extra-config cannot be read")


def test_an_unexpected_error_starts_sglang_without_the_cache_and_logs_the_traceback_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(args: Any, environ: Any = None) -> Any:
        raise KeyError("surprise")

    monkeypatch.setattr(activation, "plan", broken)
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        for _ in range(2):
            args = server_args(disable_radix_cache=True)
            assert not fill_server_args(args, ON)
            assert args.disable_radix_cache and args.hicache_storage_backend is None
    raised = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert len(raised) == 1 and "surprise" in str(raised[0])
    assert explicit_flags() in kvharbor_lines(caplog)[0]


def test_register_hooks_sglangs_argument_resolution_and_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("KVHARBOR", "1")
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    activation.register()
    assert [hook for _, hook, _ in HookRegistry._hooks[RESOLVE_TARGET]] == [activation._before_resolve]
    assert [hook for _, hook, _ in HookRegistry._hooks[STOP_TARGET]] == [activation._flush_then_stop]
