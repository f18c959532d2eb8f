"""`bench/gateway_load.py`'s own parts: round trips recorded per process and read by window,
a case's figures, and engine processes started side by side (`bench/common.py`). No gateway
or engine runs here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from common import BENCH_LINE_PREFIX, start_engine_process  # noqa: E402
from gateway_load import RoundTrips, Served, case_figures  # noqa: E402

from kvharbor.gateway import protocol as p  # noqa: E402

LOOKUP, GET = int(p.MessageType.LOOKUP), int(p.MessageType.GET)


def test_round_trips_are_read_by_window_and_a_forked_child_writes_its_own_file(tmp_path: Path) -> None:
    recorder = RoundTrips(tmp_path)
    recorder._record(LOOKUP, 100, 7)
    recorder._record(GET, 200, 9)
    child = os.fork()
    if child == 0:  # The child's records go to a file of its own, as a forked vLLM worker's.
        recorder._record(GET, 150, 11)
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    recorder._record(LOOKUP, 300, 13)
    assert len(list(tmp_path.glob("rtt-*.bin"))) == 2
    assert sorted(RoundTrips.read(tmp_path, 100, 300)) == [(LOOKUP, 7), (GET, 9), (GET, 11)]
    assert RoundTrips.read(tmp_path, 250, 400) == [(LOOKUP, 13)]


def test_a_case_is_figured_over_its_window() -> None:
    before = Served(at_ns=0, cpu_s=1.0, requests=100, moved_bytes=0)
    after = Served(at_ns=2_000_000_000, cpu_s=2.0, requests=1100, moved_bytes=4 * 2**30)
    samples = [(LOOKUP, 1000 * (i + 1)) for i in range(100)] + [(GET, 500_000)]
    figures = case_figures("c", before, after, samples)
    assert figures["c_requests_per_s"] == 500
    assert figures["c_gib_per_s"] == 2
    assert figures["c_gateway_cpu_s_per_gib"] == 0.25
    assert figures["c_gateway_busy"] == 0.5
    assert figures["c_rtt_samples"] == 101
    assert figures["c_lookup_rtt_p50_us"] == 51
    assert figures["c_lookup_rtt_p99_us"] == 100
    assert figures["c_rtt_p99_us"] == 100


def test_engines_start_side_by_side_and_a_none_leaves_a_variable_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "engine.py"
    script.write_text(
        "import json, os, sys\n"
        f"print({BENCH_LINE_PREFIX!r} + json.dumps({{'spec': open(sys.argv[2]).read(), "
        "'space': os.environ.get('VLLM_CPU_KVCACHE_SPACE'), 'mine': os.environ.get('KVH_TEST')}))\n"
    )
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # The parent's is never passed on.
    first = start_engine_process(str(script), {"n": 1}, {"KVH_TEST": "a"}, tmp_path, tmp_path, "one")
    second = start_engine_process(str(script), {"n": 2}, {"VLLM_CPU_KVCACHE_SPACE": None}, tmp_path, tmp_path, "two")
    one, two = first.report(), second.report()
    assert (one["spec"], one["space"], one["mine"]) == ('{"n": 1}', "2", "a")  # The default.
    assert (two["spec"], two["space"], two["mine"]) == ('{"n": 2}', None, None)
