"""The dashboard's parts on their own: the Host parsing, the exposure rule, the history's
rates, the readiness answer and the config editor's key sorting."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kvharbor.cache.store import StoreStatus
from kvharbor.cache.tier import TierStatus
from kvharbor.config import Config, DashboardSection, load_config
from kvharbor.dashboard.app import build_app
from kvharbor.dashboard.config_edit import ConfigEditor, ConfigEditRefused, leaves
from kvharbor.dashboard.guard import exposure_problem, host_name
from kvharbor.dashboard.history import History
from kvharbor.dashboard.hooks import GatewayHooks
from kvharbor.dashboard.logbuffer import RecentLog
from kvharbor.telemetry.metrics import HitCounts, TierCounts
from tests.support.real_gateway import RealGateway


def test_host_name_drops_the_port() -> None:
    assert host_name("localhost:9400") == "localhost"
    assert host_name("LocalHost") == "localhost"
    assert host_name("[::1]:9400") == "::1"
    assert host_name("[::1]") == "::1"


def test_a_bind_beyond_loopback_needs_a_token() -> None:
    assert exposure_problem(DashboardSection()) is None
    assert exposure_problem(DashboardSection(host="localhost")) is None
    assert exposure_problem(DashboardSection(host="::1")) is None
    problem = exposure_problem(DashboardSection(host="0.0.0.0"))
    assert problem is not None and "dashboard.auth_token" in problem
    assert exposure_problem(DashboardSection(host="0.0.0.0", auth_token="t")) is None


def _status(query: int, hit: int, used: int, evictions: int) -> StoreStatus:
    tier = TierStatus(
        "ram", "ram", "none", 1000, used, 1, "ok", "", "closed", TierCounts(evictions=evictions), allocated_bytes=used
    )
    return StoreStatus([tier], "write_through", HitCounts(lookups=1, lookup_tokens=query, hit_tokens=hit))


def test_history_rates_are_per_interval_and_the_ring_is_bounded() -> None:
    statuses = iter([_status(0, 0, 0, 0), _status(100, 50, 10, 0), _status(100, 50, 20, 2), _status(300, 250, 5, 7)])
    history = History(lambda: next(statuses), interval_s=60.0, samples_max=3)
    for _ in range(4):
        history.take()
    document = history.document()
    assert len(document["t"]) == 3, "the oldest sample left the ring"
    assert document["hit_rate"] == [None, None, 1.0], "no lookup in an interval: no rate"
    assert document["tiers"]["ram"] == {"capacity_bytes": 1000, "used_bytes": [10, 20, 5], "evictions": [None, 2, 5]}


def test_readyz_answers_503_with_the_reason(tmp_path: Path) -> None:
    gateway = RealGateway(tmp_path).start()
    try:
        server = gateway.server
        assert server is not None and server.readiness() is None
        config = gateway.config
        hooks = GatewayHooks(
            config=lambda: config,
            apply_config=lambda _: None,
            config_path=None,
            status=dict,
            readiness=server.readiness,
            store_status=lambda: _status(0, 0, 0, 0),
            registry=lambda: server.metrics.registry,
        )
        editor = ConfigEditor(None, hooks.config, hooks.apply_config)
        app = build_app(hooks, History(hooks.store_status, 1.0, 2), RecentLog(10), editor)
        with TestClient(app, base_url="http://localhost") as web:
            assert web.get("/readyz").json() == {"status": "ready"}
            gateway.stop()
            answer = web.get("/readyz")
            assert answer.status_code == 503
            assert answer.json() == {"status": "not ready", "reason": "the gateway is stopping"}
    finally:
        gateway.close()


def test_the_editor_sorts_changed_keys_and_refuses_without_a_file(tmp_path: Path) -> None:
    path = tmp_path / "kvharbor.yaml"
    path.write_text("dashboard:\n  allow_config_edit: true\n")
    running = load_config(path, environ={})
    applied: list[Config] = []
    editor = ConfigEditor(path, lambda: running, applied.append, environ={})
    outcome = editor.edit({"dashboard": {"allowed_hosts": ["kv.example"]}, "gateway": {"ring_mb": 2048}})
    assert (outcome.applied_now, outcome.at_next_start) == (["dashboard.allowed_hosts"], ["gateway.ring_mb"])
    (live,) = applied
    assert live.dashboard.allowed_hosts == ["kv.example"] and live.gateway.ring_mb == running.gateway.ring_mb
    assert load_config(path, environ={}).gateway.ring_mb == 2048
    assert "gateway.ring_mb" in leaves({"gateway": {"ring_mb": 1}})
    with pytest.raises(ConfigEditRefused, match="without a config file"):
        ConfigEditor(None, lambda: running, applied.append).edit({})
