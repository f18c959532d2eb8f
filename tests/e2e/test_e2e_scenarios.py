"""The shipped scenarios that need the real engine: vLLM's OpenAI server (CPU build) on the tiny model.

Each scenario starts as few servers as its timeline asks (a restart is a new server
process).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvharbor.scenario.catalog import shipped
from kvharbor.scenario.runner import run_scenario
from kvharbor.scenario.schema import load_scenario

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

VLLM = [p for p in shipped() if load_scenario(p).setup.driver == "vllm"]


@pytest.mark.parametrize("path", VLLM, ids=[p.stem for p in VLLM])
def test_vllm_scenario_passes(path: Path) -> None:
    # A short directory of its own under /tmp: vLLM's ZMQ sockets live there (107-byte socket paths).
    result = run_scenario(load_scenario(path))
    assert result.passed, "\n".join(result.lines())
