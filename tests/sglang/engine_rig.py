"""Run SGLang engine processes (`engine_worker.py`) with kvharbor, as the engine test and
``bench/hicache.py`` (its engine phase) do.

`write_config` gives the engines a kvharbor config of their own: the default embedded
gateway, here with ``gateway.linger_s: 0``, so that it exits with its engine and the next
engine starts a new gateway, whose hits can only come from the file tier, which outlives
both. `run_engine` runs one engine process with ``KVHARBOR=1`` and SGLang's CPU engine, the
test shims (tests/sglang/shims) installed in each of its processes through ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.gateway.gateway_harness import write_config as gateway_config
from tests.sglang import engine_worker
from tests.sglang.shims.install import BOOT

PROMPT_TOKENS = 600


def bound_tokens(prompt_tokens: int) -> int:
    """The most a prompt can hit: whole pages, its last token always computed (592 of 600)."""
    return (prompt_tokens - 1) // engine_worker.PAGE_TOKENS * engine_worker.PAGE_TOKENS


ENGINE_WAIT_S = 300


@dataclass(frozen=True)
class Answer:
    output_ids: list[int]
    cached_tokens: int
    storage_tokens: int
    storage_backend: str | None
    seconds: float
    """The answer's wall time in the engine process (`Engine.generate`, 4 tokens)."""


def write_config(directory: Path) -> Path:
    """The engines' kvharbor config: the embedded gateway, gone with its engine, a RAM tier and
    a file tier that outlives it."""
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.125},
        {"name": "files", "type": "file", "path": str(directory / "files"), "capacity_gb": 0.5},
    ]
    return gateway_config(directory, tiers=tiers, mode="embedded", ring_mb=32, ring_mb_min=16, linger_s=0)


def run_engine(model: Path, config: Path, asks: int, log: Path, prompt_tokens: int = PROMPT_TOKENS) -> list[Answer]:
    env = {
        **os.environ,
        "KVHARBOR": "1",
        "KVHARBOR_CONFIG": str(config),
        "SGLANG_USE_CPU_ENGINE": "1",  # SGLang's own switch for its CPU engine.
        "PYTHONPATH": os.pathsep.join([str(BOOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    command = [sys.executable, engine_worker.__file__, str(model), str(prompt_tokens), "7", str(asks)]
    with open(log, "w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=ENGINE_WAIT_S)
    text = log.read_text()
    assert done.returncode == 0, f"the SGLang engine failed (exit {done.returncode}); its log ends:\n{text[-4000:]}"
    return [Answer(**json.loads(line[len("ANSWER ") :])) for line in text.splitlines() if line.startswith("ANSWER ")]
