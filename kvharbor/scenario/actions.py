"""The timeline's actions: one registry, name -> typed parameters, executor, timeline rule.

Each executor runs against a `World` and returns one line saying what happened.
``requires`` names what must hold at that point of the timeline (checked before
anything runs, `kvharbor.scenario.timeline`), ``effect`` what holds after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kvharbor.scenario.damage import damage_file_objects
from kvharbor.scenario.expectations import StatusField, judge_status, status_document
from kvharbor.scenario.schema import EngineSetup, Model
from kvharbor.scenario.world import SendResult, World

LOG_POLL_S = 0.02
"""How often `wait_log` reads the log again: a log line has no event to wait on across processes."""
STATUS_POLL_S = 0.05
"""How often `wait_status` asks the gateway again (each time a new client connection)."""


class Requirement:
    """Names of the timeline conditions (`kvharbor.scenario.timeline.TimelineState`)."""

    ENGINE = "engine"
    NO_ENGINE = "no_engine"
    GATEWAY = "gateway"
    NO_GATEWAY = "no_gateway"
    CARD = "card"
    SIM_CARD = "sim_card"
    FILES = "files"
    TARGET_UP = "target_up"
    TARGET_DOWN = "target_down"
    SHM = "shm"


# -- parameters ---------------------------------------------------------------------


class NoParams(Model):
    pass


class StartGateway(Model):
    start_clean: bool = False
    refused: bool = False
    """The gateway is expected to refuse to start (its log says why); the run goes on without it."""
    release: str | None = Field(None, min_length=1)
    """The release the gateway says it is (None: this one): a gateway of another release."""


class Change(Model):
    """A change of some settings: each field left None stays as it is."""

    def given(self) -> dict[str, Any]:
        """The fields this change sets, with their new values."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class EngineChange(Change):
    """Fields of `EngineSetup` that differ from the scenario's setup (a changed layout, salt rule, release)."""

    model: str | None = None
    model_revision: str | None = None
    tp_size: int | None = Field(None, ge=1, le=8)
    kv_dtype: str | None = None
    chunk_size: int | None = Field(None, gt=0)
    key_namespace: str | None = None
    require_cache_salt: bool | None = None
    release: str | None = None

    def applied(self, base: EngineSetup) -> EngineSetup:
        return base.model_copy(update=self.given())


class Prompt(Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    tokens: int = Field(gt=0, le=65536)
    salt: str | None = None
    count: int = Field(1, ge=1, le=1000)
    """``count`` > 1: prompts ``name-0`` .. ``name-{count-1}``, each its own prefix."""


class Send(Model):
    prompts: list[Prompt] = Field(min_length=1)
    rounds: int = Field(1, ge=1, le=100)
    """Send the whole list this many times, in order."""


class CardChange(Change):
    """The config's ``card`` settings that differ from now (a changed fragment size, key eviction)."""

    fragment_bytes: int | None = Field(None, ge=4096)
    key_eviction: bool | None = None


class Fill(Model):
    ratio: float = Field(gt=0, le=1)


class Switch(Model):
    enabled: bool


class Supercap(Model):
    ok: bool


class Damage(Model):
    count: int | None = Field(None, ge=1)
    """Damage this many stored objects (None: every one)."""


class FillShm(Model):
    mb: int = Field(gt=0)


class WaitLog(Model):
    source: Literal["gateway", "engine"]
    contains: str = Field(min_length=1)
    timeout_s: float = Field(30.0, gt=0, le=600)


class WaitStatus(StatusField):
    """A `status` expectation's field and test, waited for until it holds."""

    timeout_s: float = Field(30.0, gt=0, le=600)


# -- executors ------------------------------------------------------------------------


def _start_gateway(world: World, p: StartGateway) -> str:
    ready = world.gateway.start(p.start_clean, p.release)
    if ready == p.refused:
        raise ActionFailed("the gateway " + ("started" if ready else "refused to start") + "; see its log")
    return "gateway ready" if ready else "gateway refused to start, as expected"


def _stop_gateway(world: World, _: NoParams) -> str:
    return f"gateway stopped (exit status {world.gateway.stop()})"


def _kill_gateway(world: World, _: NoParams) -> str:
    world.gateway.kill()
    return "gateway killed (SIGKILL)"


def _start_engine(world: World, p: EngineChange) -> str:
    world.start_engine(p.applied(world.setup.engine))
    return "engine started" + (" with the external cache off" if world.engine and world.engine.cache_off else "")


def _restart_engine(world: World, p: EngineChange) -> str:
    world.stop_engine()
    return _start_engine(world, p)


def _stop_engine(world: World, _: NoParams) -> str:
    world.stop_engine()
    return "engine stopped"


def _send(world: World, p: Send) -> str:
    result = SendResult()
    for _ in range(p.rounds):
        for prompt in p.prompts:
            names = [prompt.name] if prompt.count == 1 else [f"{prompt.name}-{i}" for i in range(prompt.count)]
            for name in names:
                result.requests.append(world.send(name, prompt.tokens, prompt.salt))
    world.sends.append(result)
    return f"{len(result.requests)} request(s): {result.cached_tokens} of {result.prompt_tokens} prompt tokens cached"


def _set_card(world: World, p: CardChange) -> str:
    changes = p.given()
    world.set_card(changes)
    return "card settings changed in the config: " + ", ".join(f"card.{k} {v}" for k, v in changes.items())


def _fill_card(world: World, p: Fill) -> str:
    world.card(fill_ratio=p.ratio)
    return f"card filled to {p.ratio:.0%} by another writer"


def _key_eviction(world: World, p: Switch) -> str:
    world.card(key_eviction=p.enabled)
    return f"card key eviction {'on' if p.enabled else 'off'}"


def _supercap(world: World, p: Supercap) -> str:
    world.card(supercap_ok=p.ok)
    return f"card supercapacitor {'ok' if p.ok else 'failed'}"


def _power_cycle(world: World, _: NoParams) -> str:
    world.power_cycle()
    return "card power-cycled"


def _target_down(world: World, _: NoParams) -> str:
    world.card(target_up=False)
    return "remote target down"


def _target_up(world: World, _: NoParams) -> str:
    world.card(target_up=True)
    return "remote target up"


def _damage_files(world: World, p: Damage) -> str:
    damaged = damage_file_objects(world.file_dir, p.count)
    return f"{damaged} stored object(s) damaged on disk"


def _fill_shm(world: World, p: FillShm) -> str:
    world.fill_shm(p.mb)
    return f"{p.mb} MiB of the shared-memory filesystem taken"


def _wait_log(world: World, p: WaitLog) -> str:
    """Wait for the line itself (a tier found back by the gateway's background probe), bounded."""
    deadline = time.monotonic() + p.timeout_s
    while p.contains not in world.log(p.source):
        if time.monotonic() > deadline:
            raise ActionFailed(f"no {p.source} log line with {p.contains!r} within {p.timeout_s} s")
        time.sleep(LOG_POLL_S)
    return f"{p.source} log said {p.contains!r}"


def _wait_status(world: World, p: WaitStatus) -> str:
    """Wait for the gateway's status to say it (a vLLM engine's saves are committed by a
    background thread after the response: what the next request's lookup finds), bounded."""
    deadline = time.monotonic() + p.timeout_s
    while not (check := judge_status(status_document(world), p)).passed:
        if time.monotonic() > deadline:
            raise ActionFailed(f"{check.what}: not within {p.timeout_s} s (last: {check.found})")
        time.sleep(STATUS_POLL_S)
    return f"{check.what}: {check.found}"


class ActionFailed(RuntimeError):
    """An action did not do what the scenario said it would (its step fails)."""


@dataclass(frozen=True, slots=True)
class ActionSpec:
    params: type[Model]
    run: Callable[[World, Any], str]
    requires: tuple[str, ...]
    doc: str


R = Requirement
# fmt: off
ACTIONS: dict[str, ActionSpec] = {
    "start_gateway":  ActionSpec(StartGateway, _start_gateway, (R.NO_GATEWAY,), "start the gateway"),
    "stop_gateway":   ActionSpec(NoParams, _stop_gateway, (R.GATEWAY,), "stop the gateway with SIGTERM"),
    "kill_gateway":   ActionSpec(NoParams, _kill_gateway, (R.GATEWAY,), "kill the gateway with SIGKILL"),
    "start_engine":   ActionSpec(EngineChange, _start_engine, (R.NO_ENGINE,), "start the engine"),
    "restart_engine": ActionSpec(EngineChange, _restart_engine, (R.ENGINE,), "restart the engine (a new process)"),
    "stop_engine":    ActionSpec(NoParams, _stop_engine, (R.ENGINE,), "stop the engine"),
    "send":           ActionSpec(Send, _send, (R.ENGINE,), "send prompts, one request each, in order"),
    "set_card":       ActionSpec(CardChange, _set_card, (R.CARD, R.NO_GATEWAY), "change the config's card settings"),
    "fill_card":      ActionSpec(Fill, _fill_card, (R.SIM_CARD,), "another writer fills the card"),
    "key_eviction":   ActionSpec(Switch, _key_eviction, (R.SIM_CARD,), "switch the card's key eviction"),
    "supercap":       ActionSpec(Supercap, _supercap, (R.SIM_CARD,), "the supercapacitor fails or is fixed"),
    "power_cycle":    ActionSpec(NoParams, _power_cycle, (R.SIM_CARD,), "the card loses power and comes back"),
    "target_down":    ActionSpec(NoParams, _target_down, (R.SIM_CARD, R.TARGET_UP), "the remote target goes silent"),
    "target_up":      ActionSpec(NoParams, _target_up, (R.SIM_CARD, R.TARGET_DOWN), "the remote target answers again"),
    "damage_files":   ActionSpec(Damage, _damage_files, (R.FILES,), "flip a byte in stored file objects"),
    "fill_shm":       ActionSpec(FillShm, _fill_shm, (R.SHM,), "take room on the private shm tmpfs"),
    "wait_log":       ActionSpec(WaitLog, _wait_log, (), "wait for a log line (bounded by timeout_s)"),
    "wait_status":    ActionSpec(WaitStatus, _wait_status, (R.GATEWAY,), "wait for a status field (bounded)"),
}
# fmt: on
