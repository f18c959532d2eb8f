"""Real gateway processes, real clients and real /dev/shm for the gateway tests.

Every wait here is on a real event with a bound: a readiness pipe, a line on
a child's stdout, a process's exit, a condition re-checked through a real
request. Nothing sleeps to let something happen.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from kvharbor.cache.keys import KEY_BYTES
from kvharbor.config import Config, load_config
from kvharbor.gateway import detach
from kvharbor.gateway.client import GatewayClient, PutBatch

WAIT_S = 30.0
"""Bound on every wait for a process or a condition; far above what a healthy run needs."""
WORKER = Path(__file__).with_name("client_worker.py")
FINGERPRINT = bytes(range(KEY_BYTES))
VALUE_BYTES = 100_000
"""The size of the values the embedded workers store."""


def value_for(key: bytes, size: int) -> bytes:
    """The one value every writer stores under ``key``: shared keys may be put by
    several clients at once, and each must write the same bytes."""
    return random.Random(key).randbytes(size)


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    """``n`` distinct keys, distinct from those of any other ``tag``."""
    return [bytes([tag, i]) * 8 for i in range(n)]


def new_key(rng: random.Random) -> bytes:
    return rng.randbytes(KEY_BYTES)


def write_config(
    directory: Path,
    *,
    tiers: list[dict[str, Any]] | None = None,
    storage: dict[str, Any] | None = None,
    card: dict[str, Any] | None = None,
    dashboard: dict[str, Any] | None = None,
    telemetry: dict[str, Any] | None = None,
    **gateway: Any,
) -> Path:
    """A config of its own for one test: socket in ``directory``, a unique shm_name, the
    dashboard and /metrics on ports the system picks (tests run side by side);
    ``storage``, ``dashboard``, ``telemetry``: more settings of those sections (no
    ``storage.fallback_path`` unless ``storage`` names one); ``card``: the card section."""
    directory.mkdir(parents=True, exist_ok=True)
    section: dict[str, Any] = {
        "mode": "service",
        "socket": str(directory / "gw.sock"),
        "shm_name": f"kvh-test-{uuid.uuid4().hex[:12]}",
        "ring_mb": 64,
        "ring_mb_min": 1,
        "shm_reserve_mb": 0,
        "request_timeout_ms": 5000,
    }
    section.update(gateway)
    document = {
        "gateway": section,
        "storage": {
            "tiers": tiers or [{"name": "ram", "type": "ram", "capacity_gb": 0.25}],
            "probe": True,
            # A test sees the tiers it names: no fallback tier in the user's cache directory.
            "fallback_path": None,
            **(storage or {}),
        },
        "dashboard": {"port": 0, **(dashboard or {})},
        "telemetry": telemetry or {"prometheus": {"port": 0}},
    }
    if card is not None:
        document["card"] = card
    path = directory / "kvharbor.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def segments_of(config: Config) -> list[Path]:
    return sorted(Path(config.gateway.shm_dir).glob(f"{config.gateway.shm_name}.*"))


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Re-check ``condition`` (each check is a real request or syscall) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"


def wait_for_exit(pid: int, timeout_s: float = WAIT_S) -> None:
    """Wait for any process (not only a child) to exit."""
    assert detach.wait_for_exit(pid, timeout_s), f"pid {pid} still running after {timeout_s} s"


def pid_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


class GatewayProcess:
    """A real ``kvharbor gateway`` subprocess; ready when it writes to its ready pipe."""

    def __init__(self, config_path: Path, start_clean: str | None = None, prefix: list[str] | None = None) -> None:
        self.config_path = config_path
        self.config = load_config(config_path, environ={})
        self.log_path = config_path.with_name(f"gateway-{uuid.uuid4().hex[:6]}.log")
        self._start_clean = start_clean
        self._prefix = prefix or []
        self.process: subprocess.Popen[bytes] | None = None

    def command(self, ready_fd: int | None = None) -> list[str]:
        command = [*self._prefix, sys.executable, "-m", "kvharbor", "gateway", "--config", str(self.config_path)]
        if self._start_clean is not None:
            command += self._start_clean.split()  # "--start-clean=1" or "--start-clean 0"
        if ready_fd is not None:
            command += ["--ready-fd", str(ready_fd)]
        return command

    def start(self, expect_ready: bool = True) -> GatewayProcess:
        read_end, write_end = os.pipe()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(write_end), pass_fds=(write_end,), stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )
        os.close(write_end)
        try:
            ready, _, _ = select.select([read_end], [], [], WAIT_S)
            answer = os.read(read_end, 16) if ready else b""
        finally:
            os.close(read_end)
        if expect_ready:
            assert answer == b"ready\n", f"gateway did not become ready; its log:\n{self.log()}"
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def wait(self, timeout_s: float = WAIT_S) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> int:
        """SIGTERM and wait for a clean exit."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.wait()

    def client(self, name: str = "test") -> GatewayClient:
        return GatewayClient.connect(self.config.gateway, name)


class Worker:
    """A client in another process (tests/gateway/client_worker.py), talking by lines.
    ``popen``: more `subprocess.Popen` arguments (``env``, ``user``, ``group``, ``extra_groups``)."""

    def __init__(self, *args: str, **popen: Any) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **popen,
        )
        self._pending = b""

    def line(self) -> str:
        """The worker's next line, read from the pipe itself: a buffered reader could hold
        the next line already, where select() would not see it."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], WAIT_S)
            assert ready, "worker said nothing"
            chunk = os.read(fd, 4096)
            assert chunk, f"worker ended early: {self.stderr()}"
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def stderr(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        assert self.process.stderr is not None
        return self.process.stderr.read().decode()

    def finish(self) -> tuple[int, str, str]:
        """Close its stdin (its cue to end) and collect (exit status, stdout rest, stderr)."""
        out, err = self.process.communicate(b"", timeout=WAIT_S)
        return self.process.returncode, (self._pending + out).decode(), err.decode()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(WAIT_S)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def remove_segments(shm_dir: Path, shm_name: str) -> None:
    for path in shm_dir.glob(f"{shm_name}.*"):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def closing_client(client: GatewayClient) -> Iterator[GatewayClient]:
    try:
        yield client
    finally:
        client.close()


def put_values(client: GatewayClient, items: list[tuple[bytes, int]]) -> int:
    """Put ``value_for(key, size)`` for each item, skipping what the gateway skips; returns stored."""
    batch = client.prepare_put(FINGERPRINT, items)
    fill(batch, items, skipped_ok=True)
    return client.commit_put(batch)


def fill(batch: PutBatch, items: list[tuple[bytes, int]], skipped_ok: bool = False) -> None:
    """Copy ``value_for(key, size)`` into each view of a prepared put; a skipped value
    fails the test unless ``skipped_ok``."""
    for view, (key, size) in zip(batch.views, items, strict=True):
        assert view is not None or skipped_ok, f"{key.hex()} was skipped"
        if view is not None:
            view[:] = value_for(key, size)


def get_values(client: GatewayClient, keys: list[bytes]) -> list[bytes]:
    """The leading hits, copied out of shared memory, and the batch released."""
    batch = client.get(FINGERPRINT, keys)
    try:
        return [bytes(view) for view in batch.views]
    finally:
        client.release(batch)


def roundtrip(client: GatewayClient, seed: int, shared: list[tuple[bytes, int]], rounds: int) -> int:
    """Rounds of: put distinct keys and the shared ones, read everything back, compare
    byte for byte. Returns the values checked; raises AssertionError on any difference."""
    rng = random.Random(seed)
    checked = 0
    for _ in range(rounds):
        own = [(new_key(rng), rng.randrange(1, 300_000)) for _ in range(rng.randrange(1, 6))]
        put_values(client, own)
        put_values(client, shared)
        keys = [key for key, _ in own]
        assert client.lookup(keys) == len(keys)
        got = get_values(client, keys)
        assert len(got) == len(own), f"{len(got)} of {len(own)} own values came back"
        for value, (key, size) in zip(got, own, strict=True):
            assert value == value_for(key, size), f"value of {key.hex()} differs"
        # Another client may not have committed a shared key yet: check what hits.
        for value, (key, size) in zip(get_values(client, [k for k, _ in shared]), shared, strict=False):
            assert value == value_for(key, size), f"shared value of {key.hex()} differs"
        checked += len(own) + len(shared)
    return checked


def shared_items(count: int = 6) -> list[tuple[bytes, int]]:
    rng = random.Random(1234)
    return [(new_key(rng), rng.randrange(1, 200_000)) for _ in range(count)]


class Lab:
    """What one test started, so that teardown can end it all."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.gateways: list[GatewayProcess] = []
        self.workers: list[Worker] = []
        self.shm: set[tuple[Path, str]] = set()
        self.detached: set[int] = set()
        """Pids of embedded gateways (no children of ours: they linger) to end at teardown."""

    def config(self, name: str = "gw", **kw: Any) -> Path:
        path = write_config(self.tmp_path / name, **kw)
        return path

    def gateway(self, config_path: Path, start_clean: str | None = None, **kw: Any) -> GatewayProcess:
        gateway = GatewayProcess(config_path, start_clean, **kw)
        self.gateways.append(gateway)
        self.shm.add((Path(gateway.config.gateway.shm_dir), gateway.config.gateway.shm_name))
        return gateway

    def worker(self, *args: str, **popen: Any) -> Worker:
        worker = Worker(*args, **popen)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        for gateway in self.gateways:
            if gateway.process is not None:
                gateway.kill()
        for pid in self.detached:
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)
                wait_for_exit(pid)
        for shm_dir, shm_name in self.shm:
            remove_segments(shm_dir, shm_name)
