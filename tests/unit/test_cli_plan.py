"""``kvharbor plan``: the command-line contract, its outputs, and bad input refused with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvharbor.cli import main


def trace(tmp_path: Path, lines: list[str] | None = None) -> Path:
    path = tmp_path / "trace.jsonl"
    if lines is None:
        shared = {"output_length": 10, "input_length": 2048}
        lines = [json.dumps({"timestamp": 100 * i, "hash_ids": [0, 1, 2, 10 + i], **shared}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["plan", "--no-progress", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = plan(
        capsys, "--trace", str(trace(tmp_path)), "--block-tokens", "512", "--capacity-tokens", "3e6,512,1536", "--json"
    )
    assert status == 0
    document = json.loads(out)
    results = document["results"]
    assert [r["capacity_tokens"] for r in results] == [512, 1536, 3_000_000]
    # 40 prompts of 4 blocks share 3: the first request misses everything, the others hit 3
    # blocks with room for 3 blocks; with room for 1 block only the tail-first order keeps block 0.
    assert results[2]["token_hit_rate"] == pytest.approx(39 * 1536 / (40 * 2048))
    assert results[1]["token_hit_rate"] == results[2]["token_hit_rate"]
    assert results[0]["token_hit_rate"] == pytest.approx(39 * 512 / (40 * 2048))
    assert document["policy"] == "lru" and document["requests"] == 40


def test_a_fleet_run_with_every_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "report"
    status, out, err = plan(
        capsys,
        "--workload", "system-prompts", "--requests", "300", "--rate-per-s", "2",
        "--capacity-tokens", "1e5,1e6", "--engines", "2", "--routing", "round-robin", "--policy", "slru",
        "--target-hit-rate", "0.2", "--out", str(out_dir),
    )  # fmt: skip
    assert status == 0, err
    assert "TTFT p50 s" in out and "smallest capacity reaching 20.0%" in out
    document = json.loads((out_dir / "report.json").read_text())
    fleet = document["results"][1]["fleet"]
    assert {"ttft_p50_s", "ttft_p99_s", "prefill_gpu_s_saved", "token_hit_rate_by_tier", "fill"} <= set(fleet)
    assert fleet["ttft_p99_s"] >= fleet["ttft_p50_s"] > 0
    page = (out_dir / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3 and 'src="http' not in page and "<link" not in page
    for name in ("hit_rate.png", "ttft.png", "fill.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--capacity-tokens", "0"], "--capacity-tokens/--card-gb: a capacity must be > 0 (got 0)"),
        (["--capacity-tokens", "1e6,-3"], "a capacity must be > 0 (got -3)"),
        (["--capacity-tokens", "1e6,lots"], "--capacity-tokens: 'lots' is not a number"),
        (["--model", "gpt-9"], "--model: unknown model 'gpt-9'"),
        (["--gpu", "a100"], "--gpu: unknown GPU 'a100'"),
        (["--policy", "fifo"], "--policy: unknown policy 'fifo'"),
        (["--routing", "random"], "--routing: unknown routing 'random'"),
        (["--block-tokens", "0"], "--block-tokens: must be > 0"),
        (["--engines", "0"], "--engines: must be > 0"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    status, out, err = plan(capsys, "--trace", str(trace(tmp_path)), *args)
    assert status == 2 and out == ""
    assert err.startswith("kvharbor: error: ") and says in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        (['{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "{oops"],
         "line 2: not valid JSON"),
        (
            ['{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
             '{"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [0]}'],
            "line 2: timestamp 3 ms is before the previous line's 9 ms",
        ),
        ([""], "holds no request"),
    ],
)  # fmt: skip
def test_a_bad_trace_exits_2_naming_the_line_and_prints_no_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], says: str
) -> None:
    status, out, err = plan(capsys, "--trace", str(trace(tmp_path, lines)), "--json")
    assert status == 2 and out == "", "a trace is never half-read into a result"
    assert says in err
