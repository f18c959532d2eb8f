"""Real vLLM processes, a real gateway and real files for the end-to-end tests.

Each test gets a `Lab`: its own TMPDIR, gateway socket, shared-memory name
and cache directory, and a config file naming them. `Lab.run` starts
`driver.py` as a fresh process (a fresh engine: a "restart" is simply the
next run), forked from the session's `Zygote` (torch and vLLM imported once,
`tests/support/zygote.py`), and returns what it reported. Every wait is on a real event with a
bound: a process's exit, a readiness pipe, a server's log line and then its
``/health`` answer (polled). No sleep stands in for a condition.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvharbor.config import load_config
from kvharbor.demo.server import VllmServer
from kvharbor.gateway import detach
from kvharbor.gateway.client import GatewayClient, GatewayError
from kvharbor.hal.file import FileDevice
from tests.support.zygote import Zygote

DRIVER = Path(__file__).with_name("driver.py")
REPO = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 300
"""Bound on one engine process; a healthy one takes 10-20 s on two cores."""
ENGINE_MODULES = (
    "torch",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.models.llama",
)
"""What the fork server imports before it forks engines: 6.9 s of an engine's start on two cores."""
READY_TIMEOUT_S = 30

CHUNK = 256
"""kvharbor's default chunk size, in tokens."""
BLOCK = 128
"""vLLM's block size on the CPU backend."""
OFF_LINE = "external KV cache turned off on this rank"
STARTED_LINE = re.compile(r"kvharbor: started an embedded gateway \(pid (\d+)\)")


def bound(num_tokens: int, chunk: int = CHUNK, block: int = BLOCK) -> int:
    """Most tokens a restart can restore: whole chunks, and never the last prompt
    position (vLLM computes it), in whole blocks."""
    return min(num_tokens // chunk * chunk, (num_tokens - 1) // block * block)


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids, past the tiny model's special tokens (0-3)."""
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


def request(prompt: list[int], salt: str | None = None, max_tokens: int = 8, logprobs: bool = False) -> dict[str, Any]:
    return {"tokens": prompt, "salt": salt, "max_tokens": max_tokens, "logprobs": logprobs}


@dataclass
class Run:
    returncode: int
    records: list[dict[str, Any]]
    log: str
    """stdout and stderr together: vLLM's log and kvharbor's."""

    def ok(self) -> Run:
        assert self.returncode == 0, f"engine exited with {self.returncode}; its log:\n{self.log[-8000:]}"
        return self

    def requests(self) -> dict[str, dict[str, Any]]:
        return {r["request"]: r for r in self.records if "request" in r}

    def rounds(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "round" in r]

    def metrics(self) -> dict[str, float]:
        found = [r["metrics"] for r in self.records if "metrics" in r]
        assert found, f"no metrics line; log:\n{self.log[-8000:]}"
        return dict(found[-1])

    def record(self, key: str) -> dict[str, Any]:
        found = [r for r in self.records if key in r]
        assert len(found) == 1, (key, found)
        return found[0]


@dataclass
class Lab:
    root: Path
    model: Path
    forks: Zygote
    """Where the engine processes are forked from."""
    shm_name: str = field(default_factory=lambda: f"kvh-e2e-{uuid.uuid4().hex[:10]}")

    def __post_init__(self) -> None:
        # Sockets (the gateway's, and vLLM's ZMQ ones in TMPDIR) get a short directory
        # of their own: a Unix socket path holds 107 bytes, and pytest's tmp_path can be deeper.
        self.runtime = Path(tempfile.mkdtemp(prefix="kvh-e2e-", dir="/tmp"))
        self.tmp = self.runtime / "tmp"
        self.tmp.mkdir()
        self.cache = self.root / "cache"
        self.socket = self.runtime / "gw.sock"
        self.config_path = self.write_config()
        self._runs = 0
        self._services: list[subprocess.Popen[bytes]] = []
        self._embedded: set[int] = set()
        """Pids of the embedded gateways the engines started: they outlive them (gateway.linger_s)."""

    def write_config(self, mode: str = "embedded", tiers: list[dict[str, Any]] | None = None, **engine: Any) -> Path:
        """The lab's config (a file tier unless ``tiers`` says otherwise); ``engine``: its engine section."""
        document: dict[str, Any] = {
            "gateway": {
                "mode": mode,
                "socket": str(self.socket),
                "shm_name": self.shm_name,
                "ring_mb": 64,
                "shm_reserve_mb": 0,
            },
            "storage": {
                # fsync off: on ext4 (data=ordered) a file tier's fsync waits for the host's whole
                # writeback, and on a CI host still writing its setup (or beside another job) the
                # first commit was seen blocked in fsync_dir past gateway.request_timeout_ms, which
                # turns the engine's cache off (an open product fault: the gateway must keep its
                # client informed while a tier's fsync lasts). These tests are about restarts of
                # processes, which the page cache survives; fsync is tested in tests/unit.
                "tiers": tiers
                or [{"name": "local", "type": "file", "path": str(self.cache), "capacity_gb": 2, "fsync": False}],
                # A lab sees the tiers it names: no fallback tier in the user's cache directory.
                "fallback_path": None,
            },
            # Ports the system picks: labs run side by side on one host.
            "dashboard": {"port": 0},
            "telemetry": {"prometheus": {"port": 0}},
        }
        if engine:
            document["engine"] = engine
        path = self.root / "kvharbor.yaml"
        path.write_text(yaml.safe_dump(document))
        return path

    def env(self, kvharbor: bool = True, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVHARBOR", "VLLM_"))}
        env.update(
            TMPDIR=str(self.tmp),
            HF_HUB_OFFLINE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            KVHARBOR_CONFIG=str(self.config_path),
            PYTHONPATH=str(REPO),
        )
        if kvharbor:
            env["KVHARBOR"] = "1"
        env.update(extra)
        return env

    def run(self, spec: dict[str, Any], env: dict[str, str] | None = None) -> Run:
        """One fresh engine process running ``spec`` (see driver.py)."""
        (run,) = self.run_together([(spec, env if env is not None else self.env())])
        return run

    def run_together(self, engines: list[tuple[dict[str, Any], dict[str, str]]]) -> list[Run]:
        """Fresh engine processes, one per (spec, environment), all started at once."""
        started = []
        for spec, env in engines:
            self._runs += 1
            spec_path = self.root / f"spec-{self._runs}.json"
            spec_path.write_text(json.dumps({"model": str(self.model), **spec}))
            log_path = self.root / f"engine-{self._runs}.log"
            started.append((self.forks.spawn([str(DRIVER), str(spec_path)], env, self.root, log_path), log_path))
        runs = []
        for process, log_path in started:
            try:
                returncode = process.wait(ENGINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for other, _ in started:
                    other.kill()
                raise
            text = log_path.read_text(errors="replace")
            records = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("E2E {")]
            runs.append(Run(returncode, records, text))
            self._embedded.update(int(pid) for pid in STARTED_LINE.findall(text))
        return runs

    def start_gateway(self) -> subprocess.Popen[bytes]:
        """``kvharbor gateway --config F`` as a service; returns once it serves."""
        read_end, write_end = os.pipe()
        with open(self.root / "gateway.log", "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvharbor", "gateway", "--config", str(self.config_path), "--ready-fd",
                 str(write_end)],
                pass_fds=(write_end,), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                env=self.env(kvharbor=False),
            )  # fmt: skip
        os.close(write_end)
        self._services.append(process)
        try:
            ready, _, _ = select.select([read_end], [], [], READY_TIMEOUT_S)
            answer = os.read(read_end, 16) if ready else b""
        finally:
            os.close(read_end)
        assert answer == b"ready\n", f"gateway did not become ready: {self.gateway_log()}"
        return process

    def stored_objects(self, cache: Path | None = None) -> int:
        """Objects in the file tier (the lab's, or the one at ``cache``), counted on disk once
        the engines that wrote them are gone."""
        return sum(1 for _ in FileDevice("local", str(cache or self.cache), 64 << 20).scan())

    def gateway_log(self) -> str:
        path = self.root / "gateway.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_gateway_log(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the service gateway's log says ``text`` (it hears of a client's death on
        its own thread, a moment after the client's exit), bounded."""
        gateway = self._services[-1]
        deadline = time.monotonic() + timeout_s
        while text not in self.gateway_log():
            assert time.monotonic() < deadline, f"the gateway did not log {text!r}:\n{self.gateway_log()[-4000:]}"
            with contextlib.suppress(subprocess.TimeoutExpired):
                gateway.wait(0.1)  # A pause between reads that ends early if the gateway exits.

    def embedded_gateway_log(self) -> str:
        """The log of the embedded gateway an engine started (it writes beside its socket)."""
        path = detach.log_path(self.socket)
        return path.read_text(errors="replace") if path.exists() else ""

    def gateway_client(self) -> GatewayClient:
        """A client of the lab's gateway, for its status (it counts as attached while open)."""
        return GatewayClient.connect(load_config(self.config_path, environ={}).gateway, "e2e-test")

    def _end_lingering_gateways(self) -> None:
        """End the embedded gateways of this test's engines, which outlive them (gateway.linger_s):
        those the engines' logs named, and the one at the lab's socket (a server's)."""
        pids = set(self._embedded)
        try:
            client = self.gateway_client()
        except GatewayError:
            pass  # None answers (or one we cannot use: it is among those the logs named).
        else:
            pids.add(client.hello.gateway_pid)
            client.close()
        for pid in pids:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # Gone already.
            if b"kvharbor" in command and b"gateway" in command:  # Not a process that reused its pid.
                os.kill(pid, signal.SIGTERM)
                assert detach.wait_for_exit(pid, READY_TIMEOUT_S), f"the embedded gateway (pid {pid}) ignored SIGTERM"

    def close(self) -> None:
        self._end_lingering_gateways()
        for process in self._services:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(READY_TIMEOUT_S)
        for segment in Path("/dev/shm").glob(f"{self.shm_name}*"):
            segment.unlink(missing_ok=True)
        shutil.rmtree(self.runtime, ignore_errors=True)


def start_server(lab: Lab) -> VllmServer:
    """vLLM's OpenAI server on the tiny model with ``KVHARBOR=1``, multiprocessing on and
    vLLM's default shutdown (``--shutdown-timeout 0``: the engine is killed at once), as
    users run it."""
    env = lab.env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    log = lab.root / f"server-{uuid.uuid4().hex[:6]}.log"
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096"]
    return VllmServer(lab.model, log, env, name="tiny", args=args, cwd=lab.root)


METRIC_TIMEOUT_S = 120
"""Bound on a metric reaching its value: a commit behind a loaded 2-core machine's engines is slow."""


def wait_for_metric(server: VllmServer, name: str, expected: float, timeout_s: float = METRIC_TIMEOUT_S) -> None:
    """Poll the server's /metrics until ``name`` reads ``expected``, bounded."""
    deadline = time.monotonic() + timeout_s
    while (value := server.metrics().get(name, 0.0)) != expected:
        assert time.monotonic() < deadline, f"{name} is {value}, not {expected}, after {timeout_s} s"
        # A pause between polls that ends early if the server exits.
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(0.1)
