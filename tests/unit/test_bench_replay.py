"""The trace replay of `bench/serve.py` (`bench/replay.py`): the workload it makes of a trace,
the figures it takes of outcomes, and the clear refusals of bad input. No engine runs here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from replay import Outcome, ReplayError, Shape, Workload, reuse_from_before, summary, windows  # noqa: E402

from kvharbor.sim.workload import read_trace  # noqa: E402

SHAPE = Shape(block_tokens=4, max_input_tokens=10, output_scale=0.5, output_tokens_max=3, vocab=50)


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    lines = [json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) for t, n, o, h in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_trace(
        tmp_path / "trace.jsonl",
        [(0, 1024, 10, [7, 8]), (1000, 1500, 1, [7, 8, 9]), (3000, 5000, 400, list(range(20, 30)))],
    )


def test_blocks_are_scaled_equal_ids_are_equal_tokens_and_prompts_are_cut(trace: Path) -> None:
    workload = Workload.from_trace(trace, SHAPE, count=3)
    first, second, third = workload.requests
    assert (first.input_tokens, first.blocks) == (8, (7, 8))  # 1024 tokens = 2 trace blocks = 8 tokens.
    assert (second.input_tokens, second.blocks) == (10, (7, 8, 9))  # ceil(1500 / 128) = 12, cut to 10.
    assert third.input_tokens == 10 and third.blocks == (20, 21, 22)
    assert [r.output_tokens for r in workload.requests] == [3, 1, 3]  # Scaled by 0.5, at least 1, capped at 3.
    one, two = workload.prompt(first), workload.prompt(second)
    assert two[:8] == one and len(two) == 10 and len(one) == 8
    assert workload.prompt(third)[:4] != one[:4]
    assert all(4 <= token < 50 for token in two)


def test_arrivals_rescaled_to_the_mean_rate(trace: Path) -> None:
    workload = Workload.from_trace(trace, SHAPE, count=3, rate_per_s=2.0)
    assert [r.arrival_s for r in workload.requests] == [0.0, pytest.approx(1 / 3), pytest.approx(1.0)]
    own = Workload.from_trace(trace, SHAPE, count=2, start=1)
    assert [r.arrival_s for r in own.requests] == [0.0, 2.0]


def test_the_slice_written_back_is_the_trace_format(trace: Path, tmp_path: Path) -> None:
    workload = Workload.from_trace(trace, SHAPE, count=3, rate_per_s=2.0)
    workload.to_trace(tmp_path / "slice.jsonl")
    assert read_trace(tmp_path / "slice.jsonl", SHAPE.block_tokens) == [
        r._replace(arrival_s=pytest.approx(r.arrival_s)) for r in workload.requests
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "--requests: must be > 0"),
        ({"count": 4}, "holds 3 requests"),
        ({"count": 2, "rate_per_s": 0.0}, "--rate: must be a number of requests per second > 0"),
        ({"count": 2, "start": -1}, "--start: must be >= 0"),
    ],
)
def test_bad_slices_are_refused_naming_the_flag(trace: Path, kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ReplayError, match=message.replace("(", r"\(")):
        Workload.from_trace(trace, SHAPE, **kwargs)


def test_bad_shapes_are_refused_naming_the_flag() -> None:
    with pytest.raises(ReplayError, match="--block-tokens"):
        Shape(0, 10)
    with pytest.raises(ReplayError, match="--max-input-tokens 3"):
        Shape(4, 3)
    with pytest.raises(ReplayError, match="--output-scale"):
        Shape(4, 10, output_scale=0)


def outcome(index: int, phase: int, sent_s: float, prompt: int, cached: int, ttft_s: float = 0.1) -> Outcome:
    return Outcome(index, phase, sent_s, prompt, 3, sent_s=sent_s, ttft_s=ttft_s, e2e_s=ttft_s + 0.2,
                   output_tokens=3, cached_tokens=cached)  # fmt: skip


def test_summary_and_windows_count_what_was_served() -> None:
    outcomes = [outcome(0, 0, 0.0, 100, 0, 0.1), outcome(1, 0, 5.0, 100, 50, 0.3), outcome(2, 1, 1.0, 200, 100)]
    outcomes.append(Outcome(3, 1, 2.0, 100, 3, error="HTTP 500: boom"))
    figures = summary(outcomes, active_s=2.0)
    assert (figures.requests, figures.failed, figures.errors) == (4, 1, ["HTTP 500: boom"])
    assert figures.requests_per_s == 1.5 and figures.output_tokens_per_s == 4.5
    assert figures.hit_rate == 0.375 and figures.prompt_tokens == 400
    assert figures.tpot_ms["p50"] == 100.0
    rows = windows(outcomes, window_s=4.0)
    assert [(r["phase"], r["from_s"], r["requests"], r["hit_rate"]) for r in rows] == [
        ("before", 0.0, 1, 0.0),
        ("before", 4.0, 1, 0.5),
        ("after", 0.0, 1, 0.5),
    ]
    with pytest.raises(ReplayError, match="--window-s"):
        windows(outcomes, 0)
    assert math.isnan(Outcome(9, 0, 0.0, 1, 1).ttft_s) and Outcome(9, 0, 0.0, 1, 1).tpot_s is None


def test_reuse_from_before_counts_only_what_outlived_the_restart(trace: Path) -> None:
    workload = Workload.from_trace(trace, Shape(4, 40, vocab=50), count=3)
    # Request 0 (blocks 7, 8) before; request 1 (7, 8, 9) after: its 2 leading blocks only a
    # cache that outlived the restart holds. Request 2 shares nothing.
    outcomes = [outcome(0, 0, 0.0, 8, 0), outcome(1, 1, 0.0, 12, 4), outcome(2, 1, 1.0, 40, 0)]
    assert reuse_from_before(workload, outcomes) == {"reusable_tokens": 8, "hit_tokens": 4}


def test_the_command_refuses_a_trace_that_is_not_json_lines(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 100}))
    (tmp_path / "bad.jsonl").write_text("timestamp,input_length\n")
    for extra, message in (
        (["--trace", str(tmp_path / "bad.jsonl")], "line 1: not valid JSON"),
        (["--rate", "0"], "--rate: must be a number of requests per second > 0"),
        (["--modes", "none,fast"], "--modes: unknown mode 'fast'"),
    ):
        done = subprocess.run(
            [sys.executable, str(REPO / "bench" / "serve.py"), "--model", str(tmp_path / "model"),
             "--out", str(tmp_path / "out"), *extra],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
