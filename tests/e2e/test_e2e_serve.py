"""`bench/serve.py` as a user runs it: a slice of the shared Mooncake trace replayed against real
vLLM OpenAI servers on the tiny model, kvharbor restarted half-way, vLLM's own CPU offloading beside it.

One replay (120 requests, 2 clients, the CPU engine's prefix cache held to 64 blocks so that the
trace's reuse reaches the connector) checks the accounting, never a time: the hit tokens the bench
attributes to each source add up to the engine's own counters and to the cached tokens the server
reported per request; after the restart the new engine hits what only the first engine had seen;
kvharbor's dropped saves are the engine's own count; ``kvharbor plan`` ran on the same slice; and
vLLM's CPU offloading, which the CPU build refuses, is reported with vLLM's reason while the other
mode still runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
REPLAY_TIMEOUT_S = 540
"""About 3x the replay's 3 minutes on a 2-vCPU machine: three engine starts and 120 requests."""


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("serve")
    command = [
        sys.executable, str(REPO / "bench" / "serve.py"), "--trace", str(TRACE), "--model", str(tiny_model),
        "--requests", "120", "--clients", "2", "--modes", "vllm-cpu,kvharbor", "--restart", "--plan",
        "--server-args", "--num-gpu-blocks-override 64", "--out", str(out / "run"), "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report: dict[str, Any] = json.loads((out / "run" / "serve.json").read_text())
    report["stdout"] = done.stdout
    report["out"] = out / "run"
    return report


def mode(report: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [r for r in report["results"] if r["mode"] == name]
    return found


def test_hit_tokens_by_source_add_up_to_the_engines_counters(replay: dict[str, Any]) -> None:
    harbor = mode(replay, "kvharbor")
    assert harbor["requests"] == 120 and harbor["failed"] == 0, harbor["errors"]
    hits, accounting = harbor["hit_tokens"], harbor["accounting"]
    assert hits["ram"] + hits["storage"] == hits["external"]
    assert accounting["engine_hit_tokens"] == hits["gpu"] + hits["external"] == accounting["cached_tokens_reported"]
    assert accounting["engine_prompt_tokens"] == harbor["prompt_tokens"]
    assert harbor["computed_prompt_tokens"] == harbor["prompt_tokens"] - harbor["cached_tokens"]
    assert hits["external"] > 0, "the trace's reuse beyond the engine's 64 blocks reached kvharbor"
    assert harbor["bytes"]["loaded"] > 0 and harbor["bytes"]["stored"] > 0
    counters = harbor["engine_counters"]
    assert harbor["saves_dropped_chunks"] == counters.get("vllm:kvharbor_save_dropped_total", 0.0)
    rows = [json.loads(line) for line in (replay["out"] / "requests-kvharbor.jsonl").read_text().splitlines()]
    assert sum(row["cached_tokens"] for row in rows) == accounting["cached_tokens_reported"]


def test_after_the_restart_the_new_engine_hits_what_the_first_one_stored(replay: dict[str, Any]) -> None:
    harbor = mode(replay, "kvharbor")
    assert len(harbor["engine_start_s"]) == 2
    restart = harbor["restart"]
    assert restart["reusable_tokens"] > 0, "the slice's second half reuses prefixes only its first half sent"
    assert restart["hit_tokens"] == restart["reusable_tokens"]
    phases = {row["phase"] for row in harbor["windows"]}
    assert phases == {"before", "after"}


def test_a_mode_whose_engine_does_not_start_is_reported_and_the_others_run(replay: dict[str, Any]) -> None:
    refused = mode(replay, "vllm-cpu")
    assert "engine did not start" in refused["error"]
    assert "CPU Offloading is currently only supported" in refused["error"], refused["error"]
    assert "vllm-cpu     not run" in replay["stdout"]
    figures = json.loads(replay["stdout"].splitlines()[-1])["figures"]
    assert figures["kvharbor_requests"] == 120


def test_the_planner_ran_on_the_same_slice(replay: dict[str, Any]) -> None:
    plan = replay["plan"]
    harbor = mode(replay, "kvharbor")
    assert plan["measured_token_hit_rate"] == harbor["hit_rate"]
    assert 0.0 < plan["predicted_token_hit_rate"] < 1.0
    assert plan["predicted"]["prompt_tokens"] == harbor["prompt_tokens"]
    assert len((replay["out"] / "slice.jsonl").read_text().splitlines()) == 120
