"""Runs a scenario's steps in order and gives each its verdict; the result as lines or JSON.

An action's step passes when it did what it says and the invariants hold after
it (`invariants`: every request completed, no wrong byte reached the engine, no
request cached more than its bound); an expect step passes when every one of its
checks does. A failed step does not stop the run: later steps say what followed.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvharbor.scenario.actions import ACTIONS, ActionFailed
from kvharbor.scenario.expectations import Check, Expect, judge
from kvharbor.scenario.schema import Scenario, Step
from kvharbor.scenario.world import SendResult, World


@dataclass(frozen=True, slots=True)
class StepResult:
    index: int
    kind: str
    line: int
    passed: bool
    said: str
    checks: list[Check] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    name: str
    source: str
    passed: bool
    seconds: float
    steps: list[StepResult]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def lines(self) -> list[str]:
        out = [f"scenario {self.name} ({self.source}): {'PASS' if self.passed else 'FAIL'} in {self.seconds:.1f} s"]
        for step in self.steps:
            out.append(f"  [{'pass' if step.passed else 'FAIL'}] step {step.index} {step.kind}: {step.said}")
            out += [f"      [{'pass' if c.passed else 'FAIL'}] {c.what}: {c.found}" for c in step.checks]
        return out


def invariants(send: SendResult) -> list[Check]:
    """What must hold after every request, whatever the faults."""
    requests = send.requests
    return [
        Check("every request completed", all(r.completed for r in requests), f"{len(requests)} request(s)"),
        Check(
            "no wrong byte served",
            all(r.wrong_bytes == 0 for r in requests),
            f"{sum(r.wrong_bytes for r in requests)} wrong byte(s)",
        ),
        Check(
            "hit bound holds",
            all(r.cached_tokens <= r.bound_tokens for r in requests),
            ", ".join(
                f"{r.name}: {r.cached_tokens}/{r.bound_tokens}" for r in requests if r.cached_tokens > r.bound_tokens
            )
            or "ok",
        ),
    ]


def run_step(world: World, step: Step) -> StepResult:
    if step.kind == "expect":
        assert isinstance(step.params, Expect)
        checks = judge(world, step.params)
        return StepResult(step.index, step.kind, step.line, all(c.passed for c in checks), "expectations", checks)
    sends = len(world.sends)
    try:
        said = ACTIONS[step.kind].run(world, step.params)
    except (ActionFailed, RuntimeError, OSError) as err:
        # What the run stands on failed (a gateway that never got ready): this step's verdict.
        return StepResult(step.index, step.kind, step.line, False, f"{type(err).__name__}: {err}")
    checks = invariants(world.sends[-1]) if len(world.sends) > sends else []
    return StepResult(step.index, step.kind, step.line, all(c.passed for c in checks), said, checks)


def run_scenario(scenario: Scenario, directory: Path | None = None) -> ScenarioResult:
    """Run every step (in ``directory``, else a temporary one removed afterwards)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"kvh-scenario-{scenario.name}-") as scratch:
        world = World(scenario.setup, directory or Path(scratch))
        try:
            steps = [run_step(world, step) for step in scenario.steps]
        finally:
            world.close()
    passed = all(step.passed for step in steps)
    return ScenarioResult(scenario.name, scenario.source, passed, time.monotonic() - started, steps)
