"""The demo's pieces that need no engine: its config, and what it prints and returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvharbor.cli import main
from kvharbor.config import UNIX_SOCKET_PATH_BYTES_MAX, load_config
from kvharbor.demo.dtype import choose_dtype, cpu_flags
from kvharbor.demo.run import DemoResult, write_config


def test_the_demo_config_keeps_its_data_under_its_workdir_and_its_socket_short(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)  # Deeper than a Unix socket path may be.
    config = load_config(write_config(deep), environ={})
    assert config.gateway.mode == "embedded"
    assert len(config.gateway.socket.encode()) <= UNIX_SOCKET_PATH_BYTES_MAX
    ram, files = config.storage.tiers
    assert ram.type == "ram"  # The restart restores from the lingering gateway's RAM.
    assert files.type == "file" and Path(files.path) == deep / "cache"  # type: ignore[attr-defined]
    other = load_config(write_config(tmp_path / "b"), environ={})
    assert other.gateway.shm_name != config.gateway.shm_name  # Two demos never share a segment.
    assert other.gateway.socket != config.gateway.socket


def test_the_summary_gives_tokens_and_the_gain() -> None:
    result = DemoResult(prompt_tokens=3001, cached_tokens=2816, cold_ttft_s=2.0, warm_ttft_s=0.4)
    assert result.hit
    assert result.summary() == (
        "restart hit: 2816 of 3001 prompt tokens restored from kvharbor; TTFT 2.00 s -> 0.40 s (5.0x)"
    )


def test_no_hit_is_a_failure_that_says_where_to_look() -> None:
    result = DemoResult(prompt_tokens=3001, cached_tokens=0, cold_ttft_s=1.9, warm_ttft_s=1.9)
    assert not result.hit
    assert "no restart hit" in result.summary() and "server logs" in result.summary()


def test_a_prompt_shorter_than_a_chunk_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--prompt-tokens", "100"]) == 2
    assert "--prompt-tokens must be above one chunk" in capsys.readouterr().err


# Flags lines as /proc/cpuinfo prints them (shortened): an EPYC with avx512_bf16, a Xeon with AMX,
# one without AVX-512 (this project's slow machines), and an Arm server.
EPYC_BF16 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
XEON_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
NO_AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "dtype", "said"),
    [
        (EPYC_BF16, "bfloat16", "natively (avx512_bf16)"),
        (XEON_AMX, "bfloat16", "natively (amx_bf16)"),
        (NO_AVX512, "float32", "no native bf16"),  # The first processor's flags decide.
        (ARM, "float32", "no native bf16"),
        ("", "float32", "no native bf16"),
    ],
)
def test_the_demo_computes_in_bf16_only_where_the_cpu_has_it(cpuinfo: str, dtype: str, said: str) -> None:
    choice = choose_dtype(cpuinfo)
    assert choice.dtype == dtype
    assert said in choice.reason


def test_this_machines_choice_follows_its_flags() -> None:
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    expected = "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"
    assert choose_dtype().dtype == expected
