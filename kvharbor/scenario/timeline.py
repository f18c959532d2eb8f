"""Whether a timeline can happen at all: checked on the whole file before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvharbor.scenario.actions import ACTIONS, EngineChange, Requirement, StartGateway
from kvharbor.scenario.expectations import Expect
from kvharbor.scenario.schema import vllm_ignores, vllm_refusal

if TYPE_CHECKING:
    from kvharbor.scenario.schema import Scenario, Step


@dataclass(frozen=True, slots=True)
class TimelineState:
    engine: bool = False
    gateway: bool = False
    target_down: bool = False


_WHY: dict[str, str] = {
    Requirement.ENGINE: "the engine is not running here (start_engine first)",
    Requirement.NO_ENGINE: "the engine is already running (restart_engine, or stop_engine first)",
    Requirement.GATEWAY: "the gateway is not running here",
    Requirement.NO_GATEWAY: "the gateway is already running here",
    Requirement.TARGET_UP: "the target is already down",
    Requirement.TARGET_DOWN: "the target was never taken down (target_down first)",
}


def check_timeline(scenario: Scenario) -> tuple[Step | None, str] | None:
    """The first step that cannot happen where it stands, and why; None when the timeline is possible."""
    setup = scenario.setup
    static = {
        Requirement.CARD: (setup.card is not None, "needs a card tier (setup.card)"),
        Requirement.SIM_CARD: (
            setup.card is not None and setup.card.device == "sim",
            "needs the simulated card (setup.card with device: sim): a fault comes through its control file",
        ),
        Requirement.FILES: (setup.file_mb is not None, "needs a file tier (setup.file_mb)"),
        Requirement.SHM: (setup.shm_mb is not None, "needs a private shared-memory filesystem (setup.shm_mb)"),
    }
    state = TimelineState()
    for step in scenario.steps:
        if step.kind == "expect":
            if isinstance(step.params, Expect) and step.params.same_output and setup.driver != "vllm":
                return step, "same_output needs the vllm driver (the light engine generates no text)"
            continue
        if isinstance(step.params, EngineChange) and setup.driver == "vllm":
            ignored = vllm_ignores(set(step.params.given()))
            if ignored:
                return step, vllm_refusal(ignored)
        spec = ACTIONS[step.kind]
        for need in spec.requires:
            if need in static:
                held, why = static[need]
            else:
                held, why = _holds(state, need), _WHY[need]
            if not held:
                return step, why
        state = _after(state, step)
    if not any(step.kind == "expect" for step in scenario.steps):
        return None, "no expectations: a scenario needs at least one expect step"
    return None


def _holds(state: TimelineState, need: str) -> bool:
    return {
        Requirement.ENGINE: state.engine,
        Requirement.NO_ENGINE: not state.engine,
        Requirement.GATEWAY: state.gateway,
        Requirement.NO_GATEWAY: not state.gateway,
        Requirement.TARGET_UP: not state.target_down,
        Requirement.TARGET_DOWN: state.target_down,
    }[need]


def _after(state: TimelineState, step: Step) -> TimelineState:
    kind = step.kind
    if kind == "start_gateway":
        assert isinstance(step.params, StartGateway)
        return replace(state, gateway=not step.params.refused)
    if kind in ("stop_gateway", "kill_gateway"):
        return replace(state, gateway=False)
    if kind in ("start_engine", "restart_engine"):
        return replace(state, engine=True)
    if kind == "stop_engine":
        return replace(state, engine=False)
    if kind in ("target_down", "target_up"):
        return replace(state, target_down=kind == "target_down")
    return state
