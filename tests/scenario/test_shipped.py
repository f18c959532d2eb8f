"""Every shipped light scenario, run for real: a gateway process, the connector's code paths."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from kvharbor.scenario.catalog import shipped
from kvharbor.scenario.runner import run_scenario
from kvharbor.scenario.schema import load_scenario
from kvharbor.scenario.world import World

pytestmark = pytest.mark.timeout(300)

LIGHT = [p for p in shipped() if load_scenario(p).setup.driver == "light"]


@pytest.mark.parametrize("path", LIGHT, ids=[p.stem for p in LIGHT])
def test_shipped_scenario_passes(path: Path, tmp_path: Path) -> None:
    result = run_scenario(load_scenario(path), tmp_path)
    assert result.passed, "\n".join(result.lines())


def test_the_working_set_scenario_matches_an_exact_lru_replay(tmp_path: Path) -> None:
    """The hit rate the scenario expects is what an exact LRU of the RAM tier's size predicts."""
    scenario = load_scenario(next(p for p in shipped() if p.stem == "working-set-exceeds-budget"))
    world = World(scenario.setup, tmp_path / "keys")
    try:
        chunk_bytes = 2 * 16 * 2 * 32 * 2 * 2 * 16  # layers x (K, V) x block x heads x head x bf16 x blocks
        capacity = int(scenario.setup.ram_mb * 2**20) // chunk_bytes
        lru: OrderedDict[tuple[str, int], None] = OrderedDict()
        hits = total = 0
        send = next(s.params for s in scenario.steps if s.kind == "send")
        for _ in range(send.rounds):  # type: ignore[attr-defined]
            for prompt in send.prompts:  # type: ignore[attr-defined]
                for i in range(prompt.count):
                    for chunk in range(prompt.tokens // 256):
                        key = (f"{prompt.name}-{i}", chunk)
                        total += 256
                        if key in lru:
                            hits += 256
                            lru.move_to_end(key)
                        lru[key] = None
                        while len(lru) > capacity:
                            lru.popitem(last=False)
    finally:
        world.close()
    expected = next(s.params for s in scenario.steps if s.kind == "expect").hit_rate  # type: ignore[attr-defined]
    assert expected is not None and expected.holds(hits / total), (hits, total, capacity)
