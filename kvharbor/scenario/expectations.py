"""What a timeline asserts at an ``expect`` step, typed, and how each is judged.

An ``expect`` step holds any of the fields of `Expect` (at least one); each field
is judged on what the run saw or asks now (the gateway's status and ``/metrics``,
``kvharbor doctor``, the logs) and gives one `Check` per item, pass or fail, with
what was found.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field, TypeAdapter, model_validator

from kvharbor.gateway.query import GatewayQuery, NoGateway
from kvharbor.gateway.status import GatewayStatus
from kvharbor.ops.doctor import diagnose
from kvharbor.scenario.schema import Model
from kvharbor.scenario.world import World

METRICS_TIMEOUT_S = 10.0


class Range(Model):
    """A number's allowed values: ``eq``, or ``min`` and/or ``max`` (inclusive)."""

    eq: float | None = None
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _some_bound(self) -> Range:
        if self.eq is None and self.min is None and self.max is None:
            raise ValueError("give eq, min or max")
        if self.eq is not None and (self.min is not None or self.max is not None):
            raise ValueError("eq excludes min and max")
        return self

    def holds(self, value: float) -> bool:
        if self.eq is not None:
            return value == self.eq
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def text(self) -> str:
        if self.eq is not None:
            return f"== {self.eq:g}"
        return " and ".join(
            t
            for t in (
                f">= {self.min:g}" if self.min is not None else "",
                f"<= {self.max:g}" if self.max is not None else "",
            )
            if t
        )


class LogLine(Model):
    source: Literal["gateway", "engine"]
    contains: str = Field(min_length=1)
    count: Range = Range(min=1)
    """How many lines hold it (default: at least one)."""


class StatusField(Model):
    field: str = Field(min_length=1)
    """A dotted path into ``kvharbor status --json``; a list is indexed by its items' name
    (``store.tiers.card.health``)."""
    equals: str | float | bool | None = None
    contains: str | None = None
    range: Range | None = None

    @model_validator(mode="after")
    def _one_test(self) -> StatusField:
        if sum(x is not None for x in (self.equals, self.contains, self.range)) != 1:
            raise ValueError("give exactly one of equals, contains, range")
        return self


class DoctorFinding(Model):
    prompt: str
    tokens: int = Field(gt=0)
    salt: str | None = None
    check: str
    """A finding's check (`kvharbor.ops.doctor.Finding.check`)."""
    verdict: Literal["ok", "info", "problem"] = "problem"
    contains: str | None = None
    engine_log: bool = False
    """Give doctor the engine's log (``--engine-log``)."""


class Metric(Model):
    name: str = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    value: Range
    """Of the sum of every sample of that name whose labels include ``labels``."""


class Agree(Model):
    """A status field and a metric that count the same thing must show the same number."""

    status: str = Field(min_length=1)
    metric: str = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)


class Expect(Model):
    cached_tokens: Range | None = None
    """Of the last send, summed over its requests."""
    hit_rate: Range | None = None
    """Of the last send: cached / prompt tokens."""
    cache_off: bool | None = None
    """The external cache is off on the engine's rank."""
    gateway_running: bool | None = None
    same_output: Literal[True] | None = None
    """Every request of the last send whose prompt an earlier send sent generated the text it
    generated then (greedy decoding: a KV restored wrong changes it). The vllm driver only."""
    log: list[LogLine] | None = None
    status: list[StatusField] | None = None
    doctor: list[DoctorFinding] | None = None
    metric: list[Metric] | None = None
    agree: list[Agree] | None = None

    @model_validator(mode="after")
    def _something(self) -> Expect:
        if all(getattr(self, name) is None for name in type(self).model_fields):
            raise ValueError(f"an expect step needs at least one of: {', '.join(type(self).model_fields)}")
        return self


@dataclass(frozen=True, slots=True)
class Check:
    what: str
    passed: bool
    found: str


def judge(world: World, expect: Expect) -> list[Check]:
    checks: list[Check] = []
    last = world.sends[-1] if world.sends else None
    if expect.cached_tokens is not None:
        value = last.cached_tokens if last else 0
        checks.append(
            Check(f"cached_tokens {expect.cached_tokens.text()}", expect.cached_tokens.holds(value), str(value))
        )
    if expect.hit_rate is not None:
        rate = last.cached_tokens / last.prompt_tokens if last and last.prompt_tokens else 0.0
        checks.append(Check(f"hit_rate {expect.hit_rate.text()}", expect.hit_rate.holds(rate), f"{rate:.3f}"))
    if expect.cache_off is not None:
        off = world.engine.cache_off if world.engine else True
        reason = world.engine.off_reason if world.engine else "no engine"
        checks.append(Check(f"cache_off is {expect.cache_off}", off == expect.cache_off, reason or "on"))
    if expect.gateway_running is not None:
        running = world.gateway.running
        checks.append(
            Check(f"gateway_running is {expect.gateway_running}", running == expect.gateway_running, str(running))
        )
    if expect.same_output:
        checks.append(_judge_same_output(world))
    for line in expect.log or []:
        text = world.log(line.source)
        count = sum(line.contains in row for row in text.splitlines())
        checks.append(
            Check(
                f"{line.source} log has {line.contains!r} ({line.count.text()} lines)",
                line.count.holds(count),
                f"{count} line(s)",
            )
        )
    # One status for the step's status, metric and agree checks, asked once before doctor asks the
    # gateway anything: they see one moment, the one the step found.
    status = gateway_status(world) if expect.status or expect.metric or expect.agree else None
    document = _document(status)
    samples = metric_samples(status) if expect.metric or expect.agree else None
    for item in expect.status or []:
        checks.append(judge_status(document, item))
    for finding in expect.doctor or []:
        checks.append(_judge_doctor(world, finding))
    if expect.metric:
        for metric in expect.metric:
            if samples is None:
                checks.append(Check(f"metric {metric.name}", False, "no gateway serves /metrics"))
                continue
            total = sum(v for n, labels, v in samples if n == metric.name and metric.labels.items() <= labels.items())
            checks.append(
                Check(
                    f"metric {metric.name}{metric.labels or ''} {metric.value.text()}",
                    metric.value.holds(total),
                    f"{total:g}",
                )
            )
    if expect.agree:
        checks += [_judge_agree(document, samples, item) for item in expect.agree]
    return checks


_STATUS = TypeAdapter(GatewayStatus)


def gateway_status(world: World) -> GatewayStatus | None:
    """The gateway's status, asked as ``kvharbor status`` asks it (no handshake: a gateway of
    another release answers too); None when none answers."""
    try:
        with GatewayQuery.connect(world.engine_config(world.engine_setup).gateway) as query:
            return query.status()
    except NoGateway:
        return None


def status_document(world: World) -> Any:
    """The gateway's status as ``kvharbor status --json`` writes it, asked now; None when none answers."""
    return _document(gateway_status(world))


def _document(status: GatewayStatus | None) -> Any:
    return None if status is None else _STATUS.dump_python(status, mode="json")


def metric_samples(status: GatewayStatus | None) -> list[tuple[str, dict[str, str], float]] | None:
    """Every sample of the ``/metrics`` of the gateway whose status this is; None when it serves none."""
    if status is None or not status.metrics_url:
        return None
    with urllib.request.urlopen(status.metrics_url, timeout=METRICS_TIMEOUT_S) as answer:
        text = answer.read().decode()
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def resolve(document: Any, path: str) -> Any:
    """The value at a dotted ``path``; a list is indexed by its items' ``name``; KeyError when absent."""
    node = document
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list):
            named = [item for item in node if isinstance(item, dict) and item.get("name") == part]
            if not named:
                raise KeyError(part)
            node = named[0]
        else:
            raise KeyError(part)
    return node


def _judge_same_output(world: World) -> Check:
    what = "same output as each prompt's first send"
    if not world.sends:
        return Check(what, False, "nothing sent")
    last = len(world.sends) - 1
    compared = [
        (request.name, request.output == first[1])
        for request in world.sends[-1].requests
        if (first := world.first_outputs.get((request.name, request.prompt_tokens))) is not None and first[0] < last
    ]
    if not compared:
        return Check(what, False, "no request of the last send repeats a prompt an earlier send generated from")
    differ = [name for name, same in compared if not same]
    found = f"differs: {', '.join(differ)}" if differ else f"{len(compared)} request(s) compared"
    return Check(what, not differ, found)


def judge_status(document: Any, item: StatusField) -> Check:
    what = f"status {item.field} " + (
        f"== {item.equals!r}"
        if item.equals is not None
        else f"contains {item.contains!r}"
        if item.contains is not None
        else (item.range.text() if item.range else "")
    )
    if document is None:
        return Check(what, False, "no gateway answers")
    try:
        value = resolve(document, item.field)
    except KeyError as err:
        return Check(what, False, f"no field {err.args[0]!r} there")
    if item.equals is not None:
        passed = value == item.equals
    elif item.contains is not None:
        passed = item.contains in str(value)
    else:
        assert item.range is not None
        passed = isinstance(value, (int, float)) and item.range.holds(float(value))
    return Check(what, passed, repr(value))


def _judge_agree(document: Any, samples: list[tuple[str, dict[str, str], float]] | None, item: Agree) -> Check:
    what = f"status {item.status} agrees with metric {item.metric}{item.labels or ''}"
    if document is None or samples is None:
        return Check(what, False, "no gateway answers (status or /metrics)")
    try:
        value = resolve(document, item.status)
    except KeyError as err:
        return Check(what, False, f"no field {err.args[0]!r} there")
    total = sum(v for n, labels, v in samples if n == item.metric and item.labels.items() <= labels.items())
    return Check(what, value == total, f"status {value!r}, metric {total:g}")


def _judge_doctor(world: World, item: DoctorFinding) -> Check:
    what = f"doctor finds {item.check} {item.verdict}" + (f" saying {item.contains!r}" if item.contains else "")
    report = diagnose(
        world.engine_config(world.engine_setup),
        world.prompt(item.prompt, item.tokens),
        item.salt,
        engine_log=world.engine_log if item.engine_log else None,
    )
    for finding in report.findings:
        same = finding.check == item.check and finding.verdict.value == item.verdict
        if same and (item.contains is None or item.contains in finding.text):
            return Check(what, True, finding.text)
    seen = "; ".join(f"{f.check} {f.verdict.value}: {f.text}" for f in report.findings if f.check == item.check)
    return Check(what, False, seen or "no such finding")
