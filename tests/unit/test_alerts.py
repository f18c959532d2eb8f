"""docs/alerts.yaml: Prometheus rule format, the alerts the issue asks for, only metrics
kvharbor registers, and — with promtool — each alert firing on the series that should
raise it (tests/unit/fixtures/alerts_test.yaml)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tests.support.metrics_docs import documented

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "docs" / "alerts.yaml"
PROMTOOL_TESTS = Path(__file__).parent / "fixtures" / "alerts_test.yaml"

REGISTERED_METRICS = frozenset(documented("kvharbor_")) | frozenset(documented("vllm:kvharbor_"))
"""Every metric docs/metrics.md names: test_metrics_docs keeps it equal to what the gateway's
registry and the engine's stat table register."""
PROMETHEUS_OWN = frozenset({"up"})
"""Series Prometheus makes itself for every target."""
CAPACITY_USAGE_CRITICAL = 2
"""``kvharbor_card_capacity_usage_level`` of CRITICAL (0 OK, 1 WARNING, 2 CRITICAL)."""

_DURATION = r"^(\d+(ms|s|m|h|d|w|y))+$"
_METRIC = re.compile(r"(?<![\w:])(vllm:kvharbor_\w+|kvharbor_\w+|up)(?![\w:])")


class Rule(BaseModel):
    """One alerting rule as Prometheus reads it (recording rules are not used here)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    alert: str = Field(pattern=r"^Kvharbor[A-Za-z]+$")
    expr: str = Field(min_length=1)
    for_: str = Field(alias="for", pattern=_DURATION)
    labels: dict[Literal["severity"], Literal["critical", "warning"]]
    annotations: dict[Literal["summary", "description"], str] = Field(min_length=2)


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    interval: str | None = Field(None, pattern=_DURATION)
    rules: list[Rule] = Field(min_length=1)


class RuleFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    groups: list[Group] = Field(min_length=1)


def rules() -> dict[str, Rule]:
    parsed = RuleFile.model_validate(yaml.safe_load(ALERTS.read_text()))
    found = {rule.alert: rule for group in parsed.groups for rule in group.rules}
    assert len(found) == sum(len(g.rules) for g in parsed.groups), "alert names repeat"
    return found


def metrics_of(expr: str) -> set[str]:
    # Label matchers' values ({job="kvharbor-gateway"}) are not metric names.
    return set(_METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))


def test_the_rules_are_prometheus_rule_format_with_the_alerts_asked_for() -> None:
    by_name = rules()
    uses = {name: metrics_of(rule.expr) for name, rule in by_name.items()}
    assert uses["KvharborCacheOffOnRank"] == {"vllm:kvharbor_cache_off"}
    assert uses["KvharborTierBreakerOpen"] == {"kvharbor_tier_breaker_open"}
    assert uses["KvharborCardCapacityCritical"] == {"kvharbor_card_capacity_usage_level"}
    assert by_name["KvharborCardCapacityCritical"].expr.endswith(f">= {CAPACITY_USAGE_CRITICAL}")
    assert uses["KvharborCorruptObjectsRising"] == {"kvharbor_tier_corrupt_objects_total"}
    assert "increase(" in by_name["KvharborCorruptObjectsRising"].expr  # Rising, not "ever was".
    assert uses["KvharborGatewayDown"] == {"up"}
    for name, rule in by_name.items():
        assert rule.expr.count("(") == rule.expr.count(")"), name
        assert uses[name], f"{name} uses no metric"


def test_every_metric_is_registered() -> None:
    used = set().union(*(metrics_of(rule.expr) for rule in rules().values()))
    assert used - PROMETHEUS_OWN <= REGISTERED_METRICS, sorted(used - PROMETHEUS_OWN - REGISTERED_METRICS)


def test_promtool_checks_the_rules_and_each_alert_fires_on_its_series() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, (
        "promtool is not installed: scripts/setup.sh installs it as root (apt-get install prometheus)"
    )
    for command in (["check", "rules", str(ALERTS)], ["test", "rules", str(PROMTOOL_TESTS)]):
        result = subprocess.run([promtool, *command], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout
