"""The scenario file: a setup, a timeline of actions and expectations; validated whole first.

A scenario file (YAML)::

    name: card-full-eviction-off
    symptom: the hit rate falls; the card is full and key eviction is off
    replays: "000 / The hit rate falls while serving: the card is full and key eviction is off"
    setup: {driver: light, seed: 7, card: {capacity_mb: 8, key_eviction: false}}
    steps:
      - start_gateway: {}
      - start_engine: {}
      - send: {prompts: [{name: a, tokens: 1024}]}
      - expect: {cached_tokens: {eq: 0}}

Every step is a mapping with one key: an action's name (`kvharbor.scenario.actions`)
or ``expect`` (`kvharbor.scenario.expectations`). `parse_scenario` refuses, before
anything runs, an unknown key anywhere, an unknown action, an impossible timeline
(an action before the engine starts, a target brought up that was never down, a
gateway killed that is not running), what the vllm driver cannot do (a layout
stand-in such as ``kv_dtype``, ``same_output`` elsewhere) and a timeline without
expectations; the message names the file, the line and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvharbor.scenario.marks import MarkedDict, line_of, load_marked

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,79}$"


class ScenarioError(ValueError):
    """A scenario file the user must fix; the message names FILE:LINE and the key."""


class Model(BaseModel):
    """Every scenario model: unknown keys are refused, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


SIM_ONLY_CARD_FIELDS = ("supercap_ok", "persist_delay_ms")
"""`CardSetup` fields that describe the simulated card's hardware, which a block store has not."""


class CardSetup(Model):
    """The card tier: the simulated card (`kvharbor.hal.sim.params.CardParams`, scaled real
    time), or block mode on a file of the scenario's (``device: file``)."""

    device: Literal["sim", "file"] = "sim"
    """``sim`` lives in the gateway's memory (its faults come through the control file) and
    is gone when the gateway ends; ``file`` is block mode on ``card.img`` in the scenario's
    directory (``file:PATH``), whose objects a restarted gateway finds again."""
    capacity_mb: float = Field(64.0, gt=0)
    key_eviction: bool = True
    supercap_ok: bool = True
    persist_delay_ms: float = Field(2.0, ge=0)
    """How long a write stays in the card's volatile buffer (lost at a power loss without supercapacitor)."""
    fragment_bytes: int = Field(2 << 20, ge=4096)
    region_mb: int = Field(4, gt=0)
    """``device: file``: the block store's region (``card.region_mb``), fixed when it is formatted."""

    @model_validator(mode="after")
    def _hardware_of_the_sim(self) -> CardSetup:
        sim_only = sorted(set(SIM_ONLY_CARD_FIELDS) & self.model_fields_set)
        if self.device != "sim" and sim_only:
            raise ValueError(f"{', '.join(sim_only)}: only the simulated card has it (device: sim)")
        return self


class EngineSetup(Model):
    """The engine's layout and connector settings; `restart_engine` may change any of them."""

    model: str = "kvharbor-tiny"
    model_revision: str = ""
    tp_size: int = Field(1, ge=1, le=8)
    kv_dtype: str = "bfloat16"
    chunk_size: int = Field(256, gt=0)
    block_size: int = Field(16, gt=0)
    key_namespace: str = "default"
    require_cache_salt: bool = False
    layers: int = Field(2, gt=0, le=64)
    kv_heads: int = Field(2, gt=0, le=64)
    head_size: int = Field(32, gt=0, le=512)
    release: str | None = None
    """The connector's release as it tells the gateway (None: this one): another release's engine."""


ENGINE_CONFIG_FIELDS = ("chunk_size", "key_namespace", "require_cache_salt")
"""The `EngineSetup` fields that are the connector's own config (its ``engine`` section): all a
real vLLM engine takes from a scenario. The others describe the light driver's synthetic layout;
the vllm driver runs the tiny model as it is (float32, TP 1), so it refuses them."""


def vllm_ignores(fields: set[str]) -> list[str]:
    """Of ``fields`` (engine settings a scenario sets), those the vllm driver cannot honour."""
    return sorted(fields - set(ENGINE_CONFIG_FIELDS))


def vllm_refusal(fields: list[str]) -> str:
    return (
        f"the vllm driver cannot set {', '.join(fields)} (it runs the tiny model as built: float32, TP 1); "
        f"it takes {', '.join(ENGINE_CONFIG_FIELDS)}"
    )


class Setup(Model):
    driver: Literal["light", "vllm"] = "light"
    seed: int = 0
    """Everything random in the scenario (prompt tokens, the fuzz's draws) follows from it."""
    ram_mb: float = Field(64.0, gt=0)
    """The gateway's shared-memory RAM tier."""
    file_mb: float | None = Field(None, gt=0)
    """A file tier of this size under the scenario's directory; None: none."""
    card: CardSetup | None = None
    shm_mb: int | None = Field(None, gt=0)
    """The gateway's shared memory on a private tmpfs of this size (root only); None: a
    directory of the scenario's own on the host's /dev/shm, never filled."""
    ring_mb: int = Field(16, gt=0)
    ring_mb_min: int = Field(4, gt=0)
    engine: EngineSetup = EngineSetup()
    gateway_wait_s: float = Field(60.0, gt=0, le=600)
    """How long the harness waits for the gateway to say ready, or to exit; far above what a
    healthy one needs (about a second here), so that only a hung gateway fails a step."""

    @model_validator(mode="after")
    def _vllm_takes_config_only(self) -> Setup:
        ignored = vllm_ignores(self.engine.model_fields_set) if self.driver == "vllm" else []
        if ignored:
            raise ValueError(f"engine: {vllm_refusal(ignored)}")
        return self


@dataclass(frozen=True, slots=True)
class Step:
    """One timeline entry: an action (``kind`` its name) or an expectation (``kind`` "expect")."""

    index: int
    kind: str
    params: Model
    line: int


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    symptom: str
    replays: str
    """The seed guide's symptom this scenario replays (``FILE / section: symptom``)."""
    setup: Setup
    steps: tuple[Step, ...]
    source: str
    """Where it was read from (a path, or ``<text>``)."""


class _Header(Model):
    name: str = Field(pattern=NAME_PATTERN)
    symptom: str = Field(min_length=1)
    replays: str = Field(min_length=1)
    setup: Setup = Setup()
    steps: list[Any] = Field(min_length=1)


def load_scenario(path: Path) -> Scenario:
    """Read and validate one scenario file; raises `ScenarioError`."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ScenarioError(f"{path}: cannot be read ({err.strerror})") from None
    return parse_scenario(text, str(path))


def parse_scenario(text: str, source: str = "<text>") -> Scenario:
    """Validate a whole scenario document (header, every step, the timeline); raises `ScenarioError`."""
    from kvharbor.scenario.actions import ACTIONS
    from kvharbor.scenario.expectations import Expect
    from kvharbor.scenario.timeline import check_timeline

    try:
        document = load_marked(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise ScenarioError(f"{source}:{line}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(document, MarkedDict):
        raise ScenarioError(f"{source}:1: a scenario is a mapping with name, symptom, replays, setup and steps")
    header = validate(_Header, document, source, (), 1)
    steps = []
    for index, raw in enumerate(header.steps):
        where = ("steps", index)
        line = line_of(document, where)
        if not isinstance(raw, dict) or len(raw) != 1:
            raise ScenarioError(
                f"{source}:{line}: steps[{index}]: a step is a mapping with one key: an action or expect"
            )
        ((kind, params),) = raw.items()
        params = {} if params is None else params
        if kind == "expect":
            model: type[Model] = Expect
        elif kind in ACTIONS:
            model = ACTIONS[kind].params
        else:
            raise ScenarioError(
                f"{source}:{line}: steps[{index}]: unknown action {kind!r}; known: expect, {', '.join(sorted(ACTIONS))}"
            )
        steps.append(Step(index, str(kind), validate(model, params, source, (*where, kind), line), line))
    scenario = Scenario(header.name, header.symptom, header.replays, header.setup, tuple(steps), source)
    problem = check_timeline(scenario)
    if problem is not None:
        step, text_ = problem
        where_text = f"{step.line}: steps[{step.index}].{step.kind}" if step is not None else "1: steps"
        raise ScenarioError(f"{source}:{where_text}: {text_}")
    return scenario


def validate(model: type[Model], data: Any, source: str, path: tuple[int | str, ...], line: int) -> Any:
    """``model`` from ``data`` (the part of the document at ``path``, at ``line``); the first
    error becomes a `ScenarioError` naming the line and the dotted key."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        # An unknown key first: a typo ("contain") also leaves its right name "missing".
        first = min(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
        loc = (*path, *first["loc"])
        at = line_of(data, first["loc"]) if hasattr(data, "line") else line
        raise ScenarioError(f"{source}:{at}: {dotted(loc)}: {_message(first)}") from None


def dotted(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top)"


def _message(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    return re.sub(r"\s+", " ", str(error["msg"]))
