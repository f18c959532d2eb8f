"""What one scenario run stands on: its directory, gateway, card, shared memory and engine.

`World` owns everything the run starts and ends it all in `close` (the gateway
by its pid, the private tmpfs by its mount point). Faults reach the simulated
card through its control file (`kvharbor.hal.sim.control`): the card lives in
the gateway's process, as a real card lives behind its driver.
"""

from __future__ import annotations

import contextlib
import logging
import random
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvharbor.config import Config, load_config
from kvharbor.hal.sim.control import write_control
from kvharbor.scenario.drivers.light import LightEngine, RequestOutcome
from kvharbor.scenario.gateway import GatewayProcess

if TYPE_CHECKING:
    from kvharbor.scenario.drivers.vllm import VllmEngine
from kvharbor.scenario.schema import ENGINE_CONFIG_FIELDS, CardSetup, EngineSetup, Setup
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.scenario")

TOKEN_IDS = range(4, 4096)
"""Prompt token ids: the tiny model's vocabulary past its special tokens (0-3)."""


@dataclass(slots=True)
class SendResult:
    requests: list[RequestOutcome] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)


def _engine_section(setup: EngineSetup) -> dict[str, Any]:
    """The config's engine section for an engine of ``setup``."""
    return {name: getattr(setup, name) for name in ENGINE_CONFIG_FIELDS}


class _Capture(logging.Handler):
    """The engine's kvharbor lines, into its log file (what ``doctor --engine-log`` reads)."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = path
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with open(self.path, "a") as file:
            file.write(self.format(record) + "\n")


class World:
    def __init__(self, setup: Setup, directory: Path) -> None:
        self.setup = setup
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.shm_dir = self._shm_dir()
        self.control_path = directory / "card-control.yaml"
        self.control: dict[str, Any] = {}
        self.file_dir = directory / "files"
        self.card_setup = setup.card
        """The card as configured now (`set_card` changes it between gateway runs)."""
        self.config_path = self._write_config()
        self.gateway = GatewayProcess(self.config_path, directory / "gateway.log", setup.gateway_wait_s)
        self.engine_log = directory / "engine.log"
        self.engine: LightEngine | VllmEngine | None = None
        self.engine_setup = setup.engine
        self.engine_starts = 0
        self.sends: list[SendResult] = []
        self.first_outputs: dict[tuple[str, int], tuple[int, str]] = {}
        """(prompt name, tokens) -> (the send that first sent it, the text the engine generated then)."""
        self._capture = _Capture(self.engine_log)
        logging.getLogger("kvharbor").addHandler(self._capture)
        logging.getLogger("kvharbor").setLevel(logging.INFO)

    # -- the engine ------------------------------------------------------------------

    def engine_config(self, setup: EngineSetup) -> Config:
        return load_config(self.config_path, environ={}, overrides={"engine": _engine_section(setup)})

    def start_engine(self, setup: EngineSetup) -> None:
        self.engine_setup = setup
        self.engine_starts += 1
        if self.setup.driver == "vllm":
            from kvharbor.scenario.drivers.vllm import VllmEngine

            path = self.directory / f"engine-{self.engine_starts}.yaml"
            path.write_text(
                yaml.safe_dump({**yaml.safe_load(self.config_path.read_text()), "engine": _engine_section(setup)})
            )
            self.engine = VllmEngine(path, setup, self.directory, f"vllm-{self.engine_starts}")
            self.engine_log = self.engine.log_path
        else:
            self.engine = LightEngine(self.engine_config(setup), setup, f"scenario-engine {self.engine_starts}")

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def prompt(self, name: str, tokens: int) -> list[int]:
        """The token ids of prompt ``name``: the same in every run of the scenario's seed,
        and a longer prompt of a name extends the shorter (a shared prefix)."""
        rng = random.Random(f"{self.setup.seed}:{name}")
        return [rng.choice(TOKEN_IDS) for _ in range(tokens)]

    def send(self, name: str, tokens: int, salt: str | None) -> RequestOutcome:
        if self.engine is None:
            raise RuntimeError("scenario: send before the engine started")
        outcome = self.engine.request(name, self.prompt(name, tokens), salt)
        if outcome.output is not None:
            self.first_outputs.setdefault((name, tokens), (len(self.sends), outcome.output))
        return outcome

    def log(self, source: str) -> str:
        """The gateway's log, or the engine's (its kvharbor lines)."""
        if source == "gateway":
            return self.gateway.log()
        try:
            return self.engine_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- the card --------------------------------------------------------------------

    def card(self, **changes: Any) -> None:
        """Change the card's control state (every field kept: the card applies what changed)."""
        self.control.update(changes)
        write_control(str(self.control_path), **self.control)

    def set_card(self, changes: dict[str, Any]) -> None:
        """Change the config's card settings; the next gateway (and engine) reads them."""
        if self.card_setup is None:
            raise RuntimeError("scenario: set_card needs setup.card")
        self.card_setup = CardSetup.model_validate({**self.card_setup.model_dump(exclude_unset=True), **changes})
        self._write_config()

    def power_cycle(self) -> None:
        self.card(power_cycles=int(self.control.get("power_cycles", 0)) + 1)

    # -- shared memory ---------------------------------------------------------------

    def fill_shm(self, mb: int) -> None:
        """Take ``mb`` MiB of the private shared-memory filesystem, as another program would."""
        if self.setup.shm_mb is None:
            raise RuntimeError("scenario: fill_shm needs setup.shm_mb (a private tmpfs)")
        with open(self.shm_dir / f"filler-{uuid.uuid4().hex[:8]}", "wb") as file:
            chunk = bytes(1 << 20)
            for _ in range(mb):
                file.write(chunk)

    # -- end -------------------------------------------------------------------------

    def close(self) -> None:
        logging.getLogger("kvharbor").removeHandler(self._capture)
        with contextlib.suppress(Exception):
            self.stop_engine()
        self.gateway.kill()
        if self.setup.shm_mb is not None:
            subprocess.run(["umount", str(self.shm_dir)], check=False, capture_output=True)
        else:
            for path in self.shm_dir.glob("*"):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.shm_dir.rmdir()

    # -- internals -------------------------------------------------------------------

    def _shm_dir(self) -> Path:
        if self.setup.shm_mb is None:
            # Its own directory on the host's /dev/shm: nothing here ever fills it.
            path = Path("/dev/shm") / f"kvh-scenario-{uuid.uuid4().hex[:12]}"
            path.mkdir()
            return path
        path = self.directory / "shm"
        path.mkdir(exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.setup.shm_mb}m,mode=1777", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"scenario: setup.shm_mb needs a private tmpfs, and mount refused: {done.stderr.strip()} (run as root)"
            )
        return path

    def _write_config(self) -> Path:
        setup = self.setup
        tiers: list[dict[str, Any]] = [{"name": "ram", "type": "ram", "capacity_gb": setup.ram_mb / 1024}]
        if setup.file_mb is not None:
            tiers.append(
                {
                    "name": "files",
                    "type": "file",
                    "path": str(self.file_dir),
                    "capacity_gb": setup.file_mb / 1024,
                    "fsync": False,
                }
            )
        document: dict[str, Any] = {
            "gateway": {
                "mode": "service",
                "socket": str(self.directory / "gw.sock"),
                "shm_name": f"kvh-scn-{uuid.uuid4().hex[:12]}",
                "shm_dir": str(self.shm_dir),
                "ring_mb": setup.ring_mb,
                "ring_mb_min": setup.ring_mb_min,
                "shm_reserve_mb": 0,
                "request_timeout_ms": 5000,
            },
            "storage": {
                "tiers": tiers,
                "refill_ram": False,
                # The scenario's tiers and nothing else: a local fallback beside a RAM-only setup
                # would be one directory shared by every run (~/.cache), hits leaking between them.
                "fallback_path": None,
                # A tier that failed is probed back within a fraction of a second, traffic or not.
                "backpressure": {
                    "circuit_breaker": {
                        "cooldown_s": 0.2,
                        "probe_interval_max_s": 1.0,
                        "background_probe_interval_s": 0.05,
                    }
                },
            },
            "dashboard": {"port": 0},  # It serves /metrics too, and fills the status's metrics_url.
            "telemetry": {"prometheus": {"port": 0}},
        }
        if self.card_setup is not None:
            tiers.append(self._card_tier(self.card_setup))
            document["card"] = {
                "key_eviction": self.card_setup.key_eviction,
                "fragment_bytes": self.card_setup.fragment_bytes,
                "region_mb": self.card_setup.region_mb,
            }
        path = self.directory / "kvharbor.yaml"
        path.write_text(yaml.safe_dump(document))
        return path

    def _card_tier(self, card: CardSetup) -> dict[str, Any]:
        if card.device == "file":
            # Block mode on a file (formatted at its first open): it outlives the gateway.
            image = self.directory / "card.img"
            return {"name": "card", "type": "nvme", "device": f"file:{image}", "capacity_gb": card.capacity_mb / 1024}
        params = {
            "capacity_bytes": int(card.capacity_mb * 2**20),
            "key_eviction": card.key_eviction,
            "supercap_ok": card.supercap_ok,
            "persist_delay_s": card.persist_delay_ms / 1000,
            "control_path": str(self.control_path),
            "control_poll_s": 0.01,
        }
        params_path = self.directory / "card-params.yaml"
        params_path.write_text(yaml.safe_dump(params))
        return {"name": "card", "type": "nvme", "device": f"sim:{params_path}"}
