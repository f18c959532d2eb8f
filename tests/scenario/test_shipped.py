"""Every shipped light scenario, run for real: a gateway process, the connector's code paths."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvharbor.cli import main
from kvharbor.scenario.actions import Send
from kvharbor.scenario.catalog import shipped
from kvharbor.scenario.runner import run_scenario
from kvharbor.scenario.schema import load_scenario

pytestmark = pytest.mark.timeout(300)

LIGHT = [p for p in shipped() if load_scenario(p).setup.driver == "light"]


@pytest.mark.parametrize("path", LIGHT, ids=[p.stem for p in LIGHT])
def test_shipped_scenario_passes(path: Path, tmp_path: Path) -> None:
    result = run_scenario(load_scenario(path), tmp_path)
    assert result.passed, "\n".join(result.lines())


def test_the_working_set_scenario_matches_an_exact_lru_replay() -> None:
    """The hit rate the scenario expects is what an exact LRU of the RAM tier's size predicts
    for the same prompts (chunk by chunk; headers make the real tier hold a little less)."""
    scenario = load_scenario(next(p for p in shipped() if p.stem == "working-set-exceeds-budget"))
    engine = scenario.setup.engine
    chunk_bytes = engine.layers * 2 * engine.chunk_size * engine.kv_heads * engine.head_size * 2  # K and V, bf16
    capacity = int(scenario.setup.ram_mb * 2**20) // chunk_bytes
    lru: OrderedDict[tuple[str, int], None] = OrderedDict()
    hits = total = 0
    send = next(s.params for s in scenario.steps if isinstance(s.params, Send))
    assert isinstance(send, Send)
    for _ in range(send.rounds):
        for prompt in send.prompts:
            for i in range(prompt.count):
                for chunk in range(prompt.tokens // engine.chunk_size):
                    key = (f"{prompt.name}-{i}", chunk)
                    total += engine.chunk_size
                    if key in lru:
                        hits += engine.chunk_size
                        lru.move_to_end(key)
                    lru[key] = None
                    while len(lru) > capacity:
                        lru.popitem(last=False)
    expected = next(s.params for s in scenario.steps if s.kind == "expect").hit_rate  # type: ignore[attr-defined]
    assert expected is not None and expected.holds(hits / total), (hits, total, capacity)


def test_the_cli_lists_and_runs_a_shipped_scenario_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scenario", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {s["name"] for s in listed} == {p.stem for p in shipped()}
    assert main(["scenario", "run", "version-mismatch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (only,) = result["results"]
    assert result["passed"] and only["name"] == "version-mismatch"
    assert all(step["passed"] for step in only["steps"]) and any(step["checks"] for step in only["steps"])
