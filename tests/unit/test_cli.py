"""The ``kvharbor`` command, run as users run it: a separate process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvharbor
from kvharbor.cache.keys import LayoutFingerprint, chunk_keys
from kvharbor.ops.token_ids import parse_token_ids

CONSOLE_SCRIPT = Path(sys.executable).parent / "kvharbor"


def kvharbor_cmd(
    *args: str, stdin: str = "", env: dict[str, str] | None = None, script: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvharbor`` (or the installed console script) without KVHARBOR* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVHARBOR")}
    command = [str(CONSOLE_SCRIPT)] if script else [sys.executable, "-m", "kvharbor"]
    return subprocess.run(
        [*command, *args],
        input=stdin,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("script", [False, True], ids=["python -m kvharbor", "console script"])
def test_version(script: bool) -> None:
    result = kvharbor_cmd("--version", script=script)
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvharbor {kvharbor.__version__}" == "kvharbor 0.1.0"


def test_help_lists_the_commands() -> None:
    result = kvharbor_cmd("--help")
    assert result.returncode == 0
    assert "usage: kvharbor" in result.stdout and "keys" in result.stdout


def test_no_command_is_a_usage_error() -> None:
    result = kvharbor_cmd()
    assert result.returncode == 2 and "usage: kvharbor" in result.stderr


def test_keys_prints_one_key_per_full_chunk() -> None:
    tokens = [(i * 7919) % 128256 for i in range(1000)]
    result = kvharbor_cmd(
        "keys",
        "--chunk-size",
        "256",
        "--salt",
        "tenant-a",
        "--namespace",
        "team",
        "--model",
        "meta-llama/Llama-3.1-8B",
        "--kv-dtype",
        "bfloat16",
        "--tp-size",
        "2",
        "--tp-rank",
        "1",
        "--kv-shape",
        "L0:2x16x8x128:bfloat16",
        "--kv-shape",
        "L1:2x16x8x128:bfloat16",
        stdin="\n".join(" ".join(map(str, tokens[i : i + 37])) for i in range(0, 1000, 37)),
    )
    assert result.returncode == 0, result.stderr
    layout = LayoutFingerprint(
        model_id="meta-llama/Llama-3.1-8B",
        chunk_size=256,
        kv_dtype="bfloat16",
        kv_shapes=("L0:2x16x8x128:bfloat16", "L1:2x16x8x128:bfloat16"),
        tp_size=2,
        tp_rank=1,
        key_namespace="team",
    )
    expected = chunk_keys(layout.digest(), 256, tokens, salt="tenant-a")
    assert result.stdout.splitlines() == [k.hex() for k in expected]
    assert len(expected) == 3


def test_keys_takes_chunk_size_and_namespace_from_the_config(tmp_path: Path) -> None:
    config = tmp_path / "kvharbor.yaml"
    config.write_text("engine: {chunk_size: 4, key_namespace: from-file}\n")
    result = kvharbor_cmd("keys", "--config", str(config), "--model", "m", stdin="1 2 3 4 5 6 7 8 9")
    layout = LayoutFingerprint(model_id="m", chunk_size=4, key_namespace="from-file")
    assert result.stdout.split() == [k.hex() for k in chunk_keys(layout.digest(), 4, range(1, 10))]


def test_keys_fingerprint_goes_to_stderr() -> None:
    result = kvharbor_cmd("keys", "--chunk-size", "4", "--model", "m", "--fingerprint", stdin="1 2 3 4")
    layout = LayoutFingerprint(model_id="m", chunk_size=4)
    assert result.returncode == 0
    assert layout.short() in result.stderr and layout.digest().hex() in result.stderr
    assert result.stdout.split() == [chunk_keys(layout.digest(), 4, [1, 2, 3, 4])[0].hex()]


def test_keys_of_a_prompt_shorter_than_a_chunk_explains_the_empty_output() -> None:
    result = kvharbor_cmd("keys", "--chunk-size", "256", stdin="1 2 3")
    assert result.returncode == 0 and result.stdout == ""
    assert "no full chunk" in result.stderr


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("abc", "token 'abc' at position 2 is not an integer"),
        ("1.5", "token '1.5' at position 2 is not an integer"),
        ("-1", "token id -1 at position 2 is outside 0..4294967295"),
        ("4294967296", "token id 4294967296 at position 2 is outside 0..4294967295"),
    ],
)
def test_keys_refuses_a_bad_token_by_name_and_position(token: str, message: str) -> None:
    result = kvharbor_cmd("keys", "--chunk-size", "2", stdin=f"5 6 {token} 8")
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvharbor: error: {message}"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--chunk-size", "0"], {}, "chunk_size must be a positive"),
        (["--tp-size", "2", "--tp-rank", "2"], {}, "tp_rank 2 is outside tp_size 2"),
        (["--extra", "novalue"], {}, "--extra takes NAME=VALUE"),
        ([], {"KVHARBOR_CONFIG": "/nonexistent/kvharbor.yaml"}, "does not exist"),
        ([], {"KVHARBOR__ENGINE__CHUNK_SIZE": "huge"}, "engine.chunk_size"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(args: list[str], env: dict[str, str], message: str) -> None:
    result = kvharbor_cmd("keys", *args, stdin="1 2 3 4", env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("kvharbor: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_parse_token_ids_accepts_any_whitespace() -> None:
    assert parse_token_ids(" 1\t2\n\n3  4 \r\n") == [1, 2, 3, 4]
    assert parse_token_ids("") == []
