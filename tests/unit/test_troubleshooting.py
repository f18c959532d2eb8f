"""docs/troubleshooting.md quotes what kvharbor really shows: every log line it cites is
written by the code, every metric it names is registered, every status field and doctor
check it names exists."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from kvharbor.gateway.status import GatewayStatus
from kvharbor.ops import doctor
from kvharbor.telemetry.engine_stats import ENGINE_STATS
from tests.support.log_lines import cited_line_exists
from tests.support.real_gateway import RealGateway

GUIDE = Path(__file__).parents[2] / "docs" / "troubleshooting.md"
QUOTED = re.compile(r"`([^`\n]+)`")
METRIC = re.compile(r"(?<![\w:/.-])((?:vllm:)?kvharbor_[a-z_]+)")
STATUS = re.compile(r"^status: ([\w.\[\]]+)$")
DOCTOR = re.compile(r"^doctor: (\w+)$")


def status_fields(cls: type, prefix: str = "") -> set[str]:
    """The dotted names of `GatewayStatus`'s fields, into its dataclasses (a list's items as
    ``name[]``): what the guide may cite as ``status: NAME``."""
    names: set[str] = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = prefix + field.name
        names.add(name)
        kind = hints[field.name]
        if typing.get_origin(kind) is list:
            (kind,) = typing.get_args(kind)
            name += "[]"
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            names |= status_fields(kind, name + ".")
    return names


STATUS_FIELDS = frozenset(status_fields(GatewayStatus))
DOCTOR_CHECKS = frozenset(re.findall(r'Finding\(\s*"(\w+)"', Path(doctor.__file__).read_text()))


def quoted() -> list[str]:
    return QUOTED.findall(GUIDE.read_text())


@pytest.fixture(scope="module")
def gateway_metrics(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    """The names a real gateway's registry serves (a counter's with ``_total``)."""
    gateway = RealGateway(tmp_path_factory.mktemp("gateway")).start()
    try:
        gateway.holds([bytes(16)])  # A request: the per-type series exist from the first one.
        assert gateway.server is not None
        families = list(gateway.server.metrics.registry.collect())
    finally:
        gateway.close()
    return frozenset(f"{f.name}_total" if f.type == "counter" else f.name for f in families)


def test_every_log_line_the_guide_cites_is_written_by_kvharbor() -> None:
    lines = [text for text in quoted() if text.startswith("kvharbor: ")]
    assert len(lines) > 40, "the guide cites the log lines of its symptoms"
    missing = [line for line in lines if not cited_line_exists(line)]
    assert not missing, f"cited lines that no kvharbor code writes: {missing}"


def test_every_metric_the_guide_names_is_registered(gateway_metrics: frozenset[str]) -> None:
    engine = {stat.series for stat in ENGINE_STATS if stat.exported}
    named = {name for text in quoted() for name in METRIC.findall(text)}
    assert len(named) > 15, named
    unknown = sorted(named - gateway_metrics - engine)
    assert not unknown, f"metrics the guide names that neither the gateway nor the engine registers: {unknown}"


def test_every_status_field_and_doctor_check_the_guide_names_exists() -> None:
    texts = quoted()
    fields = {m[1] for m in map(STATUS.match, texts) if m}
    checks = {m[1] for m in map(DOCTOR.match, texts) if m}
    assert fields and checks
    assert fields <= STATUS_FIELDS, sorted(fields - STATUS_FIELDS)
    assert checks <= DOCTOR_CHECKS, sorted(checks - DOCTOR_CHECKS)


def test_the_matcher_refuses_a_line_kvharbor_does_not_write() -> None:
    assert cited_line_exists("kvharbor: tier … failed its startup probe (…); skipping")
    assert not cited_line_exists("kvharbor: tier … failed its startup probe; skipping")
    # A composite line: what the hole holds must be kvharbor's text too.
    assert cited_line_exists("kvharbor: the connector refuses to start: this hybrid model has … Mamba group(s) …")
    assert not cited_line_exists("kvharbor: the connector refuses to start: this hybrid model has … fish …")
