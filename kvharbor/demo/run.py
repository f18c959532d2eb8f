"""``kvharbor demo``: a long prompt survives a vLLM restart.

1. build a small random-weight model (once; cached in the work directory);
2. start vLLM's OpenAI server with ``KVHARBOR=1`` and a kvharbor config of
   the demo's own (a RAM tier, then a file tier under the work directory; emptied first);
3. send a long prompt and time the first token (a recompute: nothing stored);
4. restart vLLM only; kvharbor's files stay;
5. send the same prompt again: the prefix comes back from kvharbor.

It prints each step, then one line such as ``restart hit: 2816 of 3001 prompt
tokens restored from kvharbor; TTFT 1.9 s -> 0.4 s (4.7x)``, and fails (exit
status 1) if the restarted server restored nothing.
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvharbor.demo.dtype import choose_dtype
from kvharbor.demo.model import build_tiny_model

EXIT_OK = 0
EXIT_NO_HIT = 1

DEMO_MODEL = {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 4, "head_dim": 64, "intermediate": 2816}
"""Large enough that prefilling ~3000 tokens on a CPU takes long enough to see the restore win."""
WARMUP_TOKENS = 64


def default_workdir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvharbor" / "demo"


@dataclass(frozen=True, slots=True)
class DemoResult:
    prompt_tokens: int
    cached_tokens: int
    cold_ttft_s: float
    warm_ttft_s: float

    @property
    def hit(self) -> bool:
        return self.cached_tokens > 0

    def summary(self) -> str:
        if not self.hit:
            return (
                f"no restart hit: 0 of {self.prompt_tokens} prompt tokens came back from kvharbor; "
                "see the server logs in the work directory"
            )
        gain = self.cold_ttft_s / self.warm_ttft_s if self.warm_ttft_s > 0 else float("inf")
        return (
            f"restart hit: {self.cached_tokens} of {self.prompt_tokens} prompt tokens restored from kvharbor; "
            f"TTFT {self.cold_ttft_s:.2f} s -> {self.warm_ttft_s:.2f} s ({gain:.1f}x)"
        )


def workdir_tag(workdir: Path) -> str:
    """A short name per work directory: a run reuses, and so cleans up, what a killed run left."""
    return hashlib.blake2b(str(workdir.resolve()).encode(), digest_size=4).hexdigest()


def short_runtime_dir(workdir: Path) -> Path:
    """Where the demo's sockets live: a Unix socket path holds at most 107 bytes, and a
    work directory (or TMPDIR, where vLLM puts its ZMQ sockets) can be deeper than that."""
    path = Path("/tmp") / f"kvh-demo-{workdir_tag(workdir)}"
    (path / "tmp").mkdir(parents=True, exist_ok=True)
    return path


def write_config(workdir: Path) -> Path:
    """The demo's own kvharbor config: its socket, shared memory, a RAM tier and a file tier under ``workdir``."""
    document = {
        "gateway": {
            "mode": "embedded",
            "socket": str(short_runtime_dir(workdir) / "gateway.sock"),
            "shm_name": f"kvharbor-demo-{workdir_tag(workdir)}",
            "ring_mb": 256,
        },
        # A RAM tier first: the restarted server restores from the lingering gateway's RAM, as a
        # production restart does; the file tier keeps the chunks across the gateway's own restarts.
        "storage": {
            "tiers": [
                {"name": "ram", "type": "ram", "capacity_gb": 1},
                {"name": "local", "type": "file", "path": str(workdir / "cache"), "capacity_gb": 8},
            ]
        },
    }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "kvharbor.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def server_env(config: Path, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHARBOR")}
    tmp = short_runtime_dir(workdir) / "tmp"
    env.update(KVHARBOR="1", KVHARBOR_CONFIG=str(config), HF_HUB_OFFLINE="1", TMPDIR=str(tmp))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


GATEWAY_STOP_TIMEOUT_S = 60.0
"""How long the demo waits for its own lingering gateway to exit when it stops it."""


def stop_gateway(config: Path) -> int | None:
    """Stop the gateway serving ``config``, if one answers (a previous demo's, lingering with
    its RAM tier); returns its pid. The demo's first request must miss, and its last server's
    gateway must not linger past the demo."""
    from kvharbor.config import load_config
    from kvharbor.gateway.client import GatewayClient, GatewayError

    section = load_config(config, environ={}).gateway
    try:
        client = GatewayClient.connect(section, "kvharbor demo")
    except GatewayError:
        return None  # None answers: nothing to stop.
    pid = client.hello.gateway_pid
    client.close()
    try:
        exited = os.pidfd_open(pid)
    except ProcessLookupError:
        return pid
    try:
        os.kill(pid, signal.SIGTERM)
        ready, _, _ = select.select([exited], [], [], GATEWAY_STOP_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"the demo's gateway (pid {pid}) did not stop within {GATEWAY_STOP_TIMEOUT_S:.0f} s")
    finally:
        os.close(exited)
    return pid


def run_demo(workdir: Path, prompt_tokens: int = 3000, say: Callable[[str], None] = print) -> DemoResult:
    from kvharbor.demo.server import VllmServer  # Light, but keeps `--help` free of it.

    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model_dir = workdir / "model"
    say(f"[1/5] building the demo model (random weights, {DEMO_MODEL['layers']} layers) in {model_dir}")
    build_tiny_model(model_dir, max_position=8192, **DEMO_MODEL)

    config = write_config(workdir)
    stop_gateway(config)  # A fresh cache: the first request must miss.
    shutil.rmtree(workdir / "cache", ignore_errors=True)
    env = server_env(config, workdir)
    # vLLM's default shutdown (0 s) kills the engine at once: the saves it finished land
    # anyway (completion marks), in the embedded gateway that outlives it.
    dtype = choose_dtype()
    say(f"      vLLM computes in {dtype.dtype}: {dtype.reason}")
    args = ["--dtype", dtype.dtype, "--max-model-len", "8192", "--enforce-eager"]
    rng = random.Random(2026)
    prompt = [rng.randrange(4, 4096) for _ in range(prompt_tokens)]
    warmup = [rng.randrange(4, 4096) for _ in range(WARMUP_TOKENS)]

    def serve(number: int) -> VllmServer:
        log = workdir / f"server-{number}.log"
        log.unlink(missing_ok=True)
        say(f"      starting vLLM's OpenAI server with KVHARBOR=1 (log: {log}) ...")
        server = VllmServer(model_dir, log, env, name="demo", args=args, cwd=workdir)
        try:
            server.wait_ready()
            server.complete(warmup, max_tokens=1)  # First-request costs are not the cache's doing.
        except BaseException:
            server.stop()
            raise
        say(f"      vLLM is up on {server.url}")
        return server

    say("[2/5] starting vLLM with kvharbor (kvharbor config: " + str(config) + ")")
    server = serve(1)
    try:
        say(f"[3/5] sending a {len(prompt)}-token prompt (nothing stored yet: vLLM computes all of it)")
        cold = server.complete(prompt)
        say(f"      time to first token {cold.ttft_s:.2f} s; cached tokens {cold.cached_tokens}")
    finally:
        server.stop()
    say(f"[4/5] restarting vLLM; kvharbor's gateway keeps the cache in RAM (and on disk in {workdir / 'cache'})")
    server = serve(2)
    try:
        say("[5/5] sending the same prompt to the restarted vLLM")
        warm = server.complete(prompt)
        say(f"      time to first token {warm.ttft_s:.2f} s; cached tokens {warm.cached_tokens}")
        metrics = server.metrics()
        say(
            f"      kvharbor restored {metrics.get('vllm:kvharbor_loaded_chunks_total', 0):.0f} chunks "
            f"({metrics.get('vllm:kvharbor_loaded_bytes_total', 0) / 2**20:.0f} MiB) "
            f"in {metrics.get('vllm:kvharbor_load_seconds_total', 0) * 1000:.0f} ms"
        )
    finally:
        server.stop()
    stopped = stop_gateway(config)
    if stopped is not None:
        say(f"      stopped the demo's embedded gateway (pid {stopped}); it would linger 600 s (gateway.linger_s)")
    say(f"      demo took {time.monotonic() - started:.0f} s")
    return DemoResult(len(prompt), warm.cached_tokens, cold.ttft_s, warm.ttft_s)
