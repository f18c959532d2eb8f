"""Fault campaigns: random timelines of the actions, invariants after every step, shrinking.

Each run draws, from its own seed (``campaign seed * 1_000_003 + run``, so a run
replays alone), a timeline over a gateway with a RAM, a file and a card tier and
the lightweight engine: prompts of a small pool (shared prefixes, salts), engine
restarts, gateway kills and clean restarts, card faults (fill, key eviction,
supercapacitor, power, remote target) and damaged files. The runner checks the
invariants after every send (`runner.invariants`); the timeline adds, after a
clean gateway restart, the recovery check of the fault model: the last prompt
acknowledged before it (sent with the cache on, nothing damaged since) is
restored in full from the file tier (docs/scenarios.md, "Fault model").

A failing run is re-run to confirm it, then shrunk: steps are dropped one at a
time while the timeline stays possible and still fails in one of
`SHRINK_TRIES` runs. ``--save`` writes the shrunk timeline as a scenario file.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import yaml

from kvharbor.scenario import actions as a
from kvharbor.scenario.expectations import Agree, Expect, Range
from kvharbor.scenario.runner import ScenarioResult, run_scenario
from kvharbor.scenario.schema import CardSetup, Model, Scenario, Setup, Step
from kvharbor.scenario.timeline import check_timeline

PROGRESS_RUNS = 50
"""A campaign says how far it got every this many runs (a long one runs for an hour)."""
SHRINK_TRIES = 3
"""Runs of a candidate timeline before a failure counts as gone (faults race real time)."""
PROMPTS = ("alpha", "beta", "gamma", "delta")
CHUNK_TOKENS = 256
BLOCK_TOKENS = 16
FUZZ_SETUP = Setup(ram_mb=2, file_mb=32, card=CardSetup(capacity_mb=16, persist_delay_ms=50))


@dataclass(slots=True)
class _Gen:
    rng: random.Random
    steps: list[tuple[str, Model]] = field(default_factory=list)
    cache_on: bool = True
    target_down: bool = False
    acknowledged: a.Prompt | None = None
    """The last prompt sent with the cache on: a clean restart must keep it."""
    damaged: bool = False
    """Objects were damaged on disk: a damaged chunk stays until rewritten, and a request
    served from RAM meanwhile rewrites nothing, so no recovery is owed after it."""

    def add(self, kind: str, params: Model) -> None:
        self.steps.append((kind, params))


def draw_timeline(seed: int, actions: int) -> list[tuple[str, Model]]:
    gen = _Gen(random.Random(seed))
    gen.add("start_gateway", a.StartGateway())
    gen.add("start_engine", a.EngineChange())
    for _ in range(actions):
        _draw_one(gen)
    agree = [
        Agree(status="store.hits.lookups", metric="kvharbor_lookups_total"),
        Agree(status="store.hits.hit_tokens", metric="kvharbor_hit_tokens_total"),
    ]
    # The engine finds a killed gateway gone at its next request, not before: one last send.
    gen.add("send", a.Send(prompts=[a.Prompt(name=gen.rng.choice(PROMPTS), tokens=600)]))
    gen.add("expect", Expect(cache_off=not gen.cache_on, agree=agree))
    return gen.steps


def _draw_one(gen: _Gen) -> None:
    rng = gen.rng
    choice = rng.choices(
        [
            "send",
            "restart_engine",
            "kill",
            "clean_restart",
            "fill",
            "eviction",
            "supercap",
            "power",
            "target",
            "damage",
        ],
        weights=[10, 2, 1, 2, 1, 1, 1, 1, 2, 1],
    )[0]
    if choice == "send":
        prompt = a.Prompt(
            name=rng.choice(PROMPTS), tokens=rng.randrange(100, 1500), salt=rng.choice([None, None, "tenant-a"])
        )
        gen.add("send", a.Send(prompts=[prompt]))
        gen.acknowledged = prompt if gen.cache_on and not gen.damaged else gen.acknowledged
    elif choice == "restart_engine":
        gen.add("restart_engine", a.EngineChange())
        gen.cache_on = True
    elif choice == "kill":
        gen.add("kill_gateway", a.NoParams())
        gen.add("start_gateway", a.StartGateway())
        gen.cache_on, gen.acknowledged = False, None  # What RAM and the card held is gone; see the fault model.
    elif choice == "clean_restart":
        gen.add("stop_gateway", a.NoParams())
        gen.add("start_gateway", a.StartGateway())
        gen.add("restart_engine", a.EngineChange())
        gen.cache_on = True
        if gen.acknowledged is not None:
            prompt = gen.acknowledged
            gen.add("send", a.Send(prompts=[prompt]))
            bound = min(
                (prompt.tokens // CHUNK_TOKENS) * CHUNK_TOKENS, ((prompt.tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
            )
            gen.add("expect", Expect(cached_tokens=Range(eq=bound)))
    elif choice == "fill":
        gen.add("fill_card", a.Fill(ratio=rng.choice([0.5, 0.9, 1.0])))
    elif choice == "eviction":
        gen.add("key_eviction", a.Switch(enabled=rng.random() < 0.5))
    elif choice == "supercap":
        gen.add("supercap", a.Supercap(ok=rng.random() < 0.5))
    elif choice == "power":
        gen.add("power_cycle", a.NoParams())
    elif choice == "target":
        gen.add("target_up" if gen.target_down else "target_down", a.NoParams())
        gen.target_down = not gen.target_down
    else:
        gen.add("damage_files", a.Damage(count=rng.randrange(1, 4)))
        gen.acknowledged, gen.damaged = None, True


def scenario_of(name: str, steps: list[tuple[str, Model]], seed: int) -> Scenario:
    return Scenario(
        name=name,
        symptom=f"fault campaign run, seed {seed}",
        replays="fault model (docs/scenarios.md): invariants after every step",
        setup=replace_seed(FUZZ_SETUP, seed),
        steps=tuple(Step(i, kind, params, i + 1) for i, (kind, params) in enumerate(steps)),
        source=f"<fuzz seed {seed}>",
    )


def replace_seed(setup: Setup, seed: int) -> Setup:
    return setup.model_copy(update={"seed": seed})


def failed_checks(result: ScenarioResult) -> set[str]:
    """What failed, by kind and check (not by step number: shrinking renumbers)."""
    return {f"{s.kind}: {c.what}" for s in result.steps if not s.passed for c in s.checks if not c.passed} | {
        f"{s.kind}: {s.said}" for s in result.steps if not s.passed and not s.checks
    }


def _fails(scenario: Scenario, tries: int, same: set[str]) -> bool:
    """Whether ``scenario`` fails with one of the ``same`` checks in any of ``tries`` runs."""
    return any(failed_checks(run_scenario(scenario)) & same for _ in range(tries))


def shrink(scenario: Scenario, same: set[str]) -> Scenario:
    """Drop steps while the timeline stays possible and still fails the same way."""
    steps = list(scenario.steps)
    for i in range(len(steps) - 1, -1, -1):
        # An expectation is judged on the send before it: the two go, or stay, together.
        if steps[i].kind == "expect" or (i + 1 < len(steps) and steps[i + 1].kind == "expect"):
            continue
        candidate = [s for j, s in enumerate(steps) if j != i]
        trial = replace_steps(scenario, candidate)
        if check_timeline(trial) is None and _fails(trial, SHRINK_TRIES, same):
            steps = candidate
    return replace_steps(scenario, steps)


def replace_steps(scenario: Scenario, steps: list[Step]) -> Scenario:
    renumbered = tuple(Step(i, s.kind, s.params, i + 1) for i, s in enumerate(steps))
    return Scenario(scenario.name, scenario.symptom, scenario.replays, scenario.setup, renumbered, scenario.source)


def to_yaml(scenario: Scenario) -> str:
    """A scenario file of ``scenario`` (what ``--save`` writes; it runs like any other)."""
    document = {
        "name": scenario.name,
        "symptom": scenario.symptom,
        "replays": scenario.replays,
        "setup": scenario.setup.model_dump(exclude_defaults=True),
        "steps": [{s.kind: s.params.model_dump(exclude_defaults=True)} for s in scenario.steps],
    }
    return yaml.safe_dump(document, sort_keys=False)


@dataclass(frozen=True, slots=True)
class Failure:
    seed: int
    reproduced: bool
    shrunk_steps: int
    failed: list[str]


@dataclass(frozen=True, slots=True)
class CampaignReport:
    runs: int
    seed: int
    seconds: float
    actions: dict[str, int]
    failures: list[Failure]

    @property
    def runs_per_minute(self) -> float:
        return self.runs / self.seconds * 60 if self.seconds else 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "runs": self.runs, "seed": self.seed, "seconds": round(self.seconds, 1),
                "runs_per_minute": round(self.runs_per_minute, 1), "actions": self.actions,
                "failures": [asdict(f) for f in self.failures],
            },
            indent=2,
        )  # fmt: skip


def campaign(
    runs: int, seed: int, actions: int, save: Path | None = None, out: TextIO | None = sys.stdout
) -> CampaignReport:
    """Run the campaign; its progress, each failure (shrunk) and the summary go to ``out``
    (None: nowhere; the CLI's ``--json`` sends them to stderr, the report to stdout)."""
    started = time.monotonic()
    counts: dict[str, int] = {}
    failures: list[Failure] = []
    for run in range(runs):
        run_seed = seed * 1_000_003 + run
        scenario = scenario_of(f"fuzz-{run_seed}", draw_timeline(run_seed, actions), run_seed)
        for step in scenario.steps:
            counts[step.kind] = counts.get(step.kind, 0) + 1
        result = run_scenario(scenario)
        if (run + 1) % PROGRESS_RUNS == 0:
            rate = (run + 1) / (time.monotonic() - started) * 60
            _say(out, f"run {run + 1} of {runs}: {len(failures)} failing so far, {rate:.1f} runs/minute")
        if result.passed:
            continue
        same = failed_checks(result)
        failed = sorted(same)
        _say(out, f"run {run} (seed {run_seed}) failed: {failed}; re-running to confirm, then shrinking")
        reproduced = _fails(scenario, SHRINK_TRIES, same)
        small = shrink(scenario, same) if reproduced else scenario
        failures.append(Failure(run_seed, reproduced, len(small.steps), failed))
        _say(out, f"run {run} (seed {run_seed}) FAILED{'' if reproduced else ' once (not reproduced)'}: {failed}")
        _say(out, to_yaml(small))
        if save is not None and len(failures) == 1:
            save.write_text(to_yaml(small))
    report = CampaignReport(runs, seed, time.monotonic() - started, dict(sorted(counts.items())), failures)
    rate = report.runs_per_minute
    _say(out, f"{runs} runs, {len(failures)} failing, {rate:.1f} runs/minute; actions: {report.actions}")
    return report


def _say(out: TextIO | None, line: str) -> None:
    if out is not None:
        print(line, file=out, flush=True)
