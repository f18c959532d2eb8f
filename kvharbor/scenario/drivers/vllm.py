"""The vLLM engine: the real CPU build's OpenAI server, with ``KVHARBOR=1``, on the tiny model.

For the scenarios about the engine itself (a restart restoring, the gateway gone,
salts, a layout change): each start is a new server process (15-40 s on two
cores), pointed at the scenario's gateway through ``KVHARBOR_CONFIG`` (service
mode: the engine never starts a gateway of its own). ``cached_tokens`` is vLLM's
own ``usage.prompt_tokens_details``, with vLLM's prefix cache off: every cached
token came from kvharbor, as with the light driver, so one process shows a hit
(or a salt's miss) without a restart. The bytes vLLM loads are not observable
from outside the engine: there the connector's own checks (checksums, keys,
read-back) stand, `RequestOutcome.wrong_bytes` is 0 by construction, and the
greedy output (`RequestOutcome.output`) is what a scenario compares: KV restored
wrong would change it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvharbor.config import default_cache_dir
from kvharbor.demo.model import build_tiny_model
from kvharbor.demo.server import VllmServer
from kvharbor.scenario.drivers.light import RequestOutcome
from kvharbor.scenario.schema import EngineSetup

VLLM_BLOCK_TOKENS = 128
"""vLLM's block size on the CPU backend."""
OUTPUT_TOKENS = 8
"""Tokens generated per request (greedy): enough that a wrong restored KV shows in the text."""
OFF_LINE = "external KV cache turned off on this rank"
"""The restart rule's line (`kvharbor.connector.link.say_off`), in the engine's log."""


def tiny_model() -> Path:
    """The tiny random-weight Llama, built once per user (`build_tiny_model` reuses it)."""
    return build_tiny_model(default_cache_dir() / "scenario-tiny-model")


class VllmEngine:
    def __init__(self, config_path: Path, setup: EngineSetup, directory: Path, name: str) -> None:
        self.setup = setup
        # vLLM leaves ZMQ sockets in TMPDIR: one of its own, short, under /tmp, since a Unix
        # socket's path holds 107 bytes and the scenario's directory (under the caller's
        # TMPDIR) can be too deep for vLLM's socket names (it exited with status 1 in CI).
        tmp = self._tmp = Path(tempfile.mkdtemp(prefix=f"kvh-{name}-", dir="/tmp"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVHARBOR", "VLLM_"))}
        env.update(
            TMPDIR=str(tmp), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0",
            KVHARBOR="1", KVHARBOR_CONFIG=str(config_path),
        )  # fmt: skip
        args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--no-enable-prefix-caching"]
        self.log_path = directory / f"{name}.log"
        self.server = VllmServer(tiny_model(), self.log_path, env, name="tiny", args=args, cwd=directory)
        try:
            self.server.wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def cache_off(self) -> bool:
        return OFF_LINE in self.server.log()

    @property
    def off_reason(self) -> str:
        return OFF_LINE if self.cache_off else ""

    def request(self, name: str, token_ids: Sequence[int], salt: str | None) -> RequestOutcome:
        n = len(token_ids)
        chunk = self.setup.chunk_size
        bound = min(n // chunk * chunk, (n - 1) // VLLM_BLOCK_TOKENS * VLLM_BLOCK_TOKENS)
        done = self.server.complete(list(token_ids), max_tokens=OUTPUT_TOKENS, salt=salt)
        return RequestOutcome(name, n, done.cached_tokens, bound, done.cached_tokens, 0, True, done.text)

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)
