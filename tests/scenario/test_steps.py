"""The steps the vLLM scenarios lean on, judged where they can fail: ``wait_status`` against
a real gateway (it waits for the field, and fails past its bound), ``same_output`` on a
changed text."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvharbor.scenario.drivers.light import RequestOutcome
from kvharbor.scenario.expectations import Expect, judge
from kvharbor.scenario.runner import run_scenario
from kvharbor.scenario.schema import Setup, parse_scenario
from kvharbor.scenario.world import SendResult, World

pytestmark = pytest.mark.timeout(120)


def test_wait_status_waits_for_the_field_and_fails_past_its_timeout(tmp_path: Path) -> None:
    scenario = parse_scenario(
        "name: waits\nsymptom: s\nreplays: r\nsetup: {seed: 3}\nsteps:\n"
        "  - start_gateway: {}\n  - start_engine: {}\n  - send: {prompts: [{name: a, tokens: 600}]}\n"
        "  - wait_status: {field: store.tiers.ram.keys, range: {min: 2}}\n"
        "  - wait_status: {field: store.tiers.ram.keys, range: {min: 3}, timeout_s: 0.5}\n"
        "  - expect: {cache_off: false}\n"
    )
    result = run_scenario(scenario, tmp_path)
    waited, timed_out = result.steps[3], result.steps[4]
    assert waited.passed and waited.said == "status store.tiers.ram.keys >= 2: 2", waited.said
    assert not timed_out.passed and timed_out.said.endswith("not within 0.5 s (last: 2)"), timed_out.said


class _Texts:
    """An engine that answers each prompt name with the next of its texts (what vLLM would
    generate, the second time from a KV restored right or wrong)."""

    cache_off = False
    off_reason = ""

    def __init__(self, texts: dict[str, Iterator[str]]) -> None:
        self.texts = texts

    def request(self, name: str, token_ids: Sequence[int], salt: str | None) -> RequestOutcome:
        n = len(token_ids)
        return RequestOutcome(name, n, 0, 0, 0, 0, True, next(self.texts[name]))

    def close(self) -> None:
        pass


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    world = World(Setup(driver="vllm"), tmp_path)
    yield world
    world.close()


def _send(world: World, *names: str) -> None:
    world.sends.append(SendResult([world.send(name, 300, None) for name in names]))


def test_same_output_compares_each_repeated_prompt_with_its_first_text(world: World) -> None:
    world.engine = _Texts({"a": iter(["x y", "x y", "x z"]), "b": iter(["q", "q"])})  # type: ignore[assignment]
    same = Expect(same_output=True)
    _send(world, "a")
    [first] = judge(world, same)
    assert not first.passed and "no request of the last send repeats" in first.found
    _send(world, "a", "b")
    [second] = judge(world, same)
    assert second.passed and second.found == "1 request(s) compared"
    _send(world, "b", "a")
    [third] = judge(world, same)
    assert not third.passed and third.found == "differs: a"
