"""A fixed-size fault campaign: random timelines, invariants after every step, none violated."""

from __future__ import annotations

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

    report = campaign(CI_RUNS, seed=20261201, actions=6, echo=True)
    assert not report.failures, report.to_json()
