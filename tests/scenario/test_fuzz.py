"""A fixed-size fault campaign: random timelines, invariants after every step, none violated."""

from __future__ import annotations

import json

import pytest

from kvharbor.scenario.fuzz import draw_timeline, scenario_of, to_yaml
from kvharbor.scenario.schema import parse_scenario

pytestmark = pytest.mark.timeout(600)

CI_RUNS = 6


def test_timelines_are_deterministic_per_seed_and_saved_files_parse() -> None:
    assert draw_timeline(5, 8) == draw_timeline(5, 8)
    assert draw_timeline(5, 8) != draw_timeline(6, 8)
    scenario = scenario_of("fuzz-5", draw_timeline(5, 8), 5)
    again = parse_scenario(to_yaml(scenario), "saved.yaml")
    assert [(s.kind, s.params) for s in again.steps] == [(s.kind, s.params) for s in scenario.steps]


def test_a_fixed_campaign_finds_no_invariant_violation() -> None:
    from kvharbor.scenario.fuzz import campaign

    report = campaign(CI_RUNS, seed=20261201, actions=6)
    assert not report.failures, report.to_json()


def test_the_cli_with_json_writes_the_report_alone_to_stdout_and_the_rest_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvharbor.cli import main

    assert main(["scenario", "fuzz", "--runs", "1", "--seed", "3", "--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["runs"] == 1 and report["failures"] == [] and report["actions"]["send"] >= 1
    assert captured.err.splitlines()[-1].startswith("1 runs, 0 failing, ")
