"""Start and restart: stale segments swept, the cache kept or emptied by --start-clean,
the ring fitted to /dev/shm, and the command line itself."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import (
    Lab,
    closing_client,
    get_values,
    put_values,
    segments_of,
    value_for,
)

from kvharbor.config import MIB, load_config
from kvharbor.gateway.shm import SHARE_HINT

pytestmark = pytest.mark.timeout(60)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# -- stale segments ----------------------------------------------------------


def test_stale_segments_are_removed_unless_mapped(lab: Lab) -> None:
    config_path = lab.config()
    config = load_config(config_path, environ={})
    shm_dir, name = Path(config.gateway.shm_dir), config.gateway.shm_name
    stale = shm_dir / f"{name}.{dead_pid()}"
    stale.write_bytes(b"\0" * 8192)
    in_use = shm_dir / f"{name}.{dead_pid()}"
    in_use.write_bytes(b"\0" * 8192)
    # A live process (an engine that outlived its gateway) still maps this one.
    holder = subprocess.Popen(
        [sys.executable, "-c", MAP_AND_WAIT, str(in_use)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"mapped\n"
        gateway = lab.gateway(config_path).start()
        assert not stale.exists()
        assert in_use.exists()
        log = gateway.log()
        assert f"removed stale shared memory {stale}" in log
        assert f"shared memory {in_use} of dead gateway pid" in log and f"still mapped by pid {holder.pid}" in log
    finally:
        holder.communicate(b"", timeout=30)
        in_use.unlink(missing_ok=True)


MAP_AND_WAIT = """
import mmap, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_segment_of_a_killed_gateway_is_removed_by_the_next(lab: Lab) -> None:
    config_path = lab.config()
    first = lab.gateway(config_path).start()
    with closing_client(first.client()) as client:
        old_segment = Path(client.hello.shm_path)
    first.kill()
    assert old_segment.exists(), "SIGKILL leaves it behind"
    second = lab.gateway(config_path).start()
    assert not old_segment.exists()
    assert f"removed stale shared memory {old_segment}" in second.log()
    assert segments_of(second.config) == [old_segment.with_name(f"{second.config.gateway.shm_name}.{second.pid}")]
    second.stop()
    assert segments_of(second.config) == [], "a clean stop removes its own"


# -- start-clean ---------------------------------------------------------------


def test_start_clean_keeps_or_empties_the_cache(lab: Lab, tmp_path: Path) -> None:
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.25},
        {"name": "local", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 1, "fsync": False},
    ]
    config_path = lab.config(tiers=tiers)
    items = [(bytes([i]) * 16, 100_000 + i) for i in range(5)]
    keys = [key for key, _ in items]
    expected = [value_for(key, size) for key, size in items]

    first = lab.gateway(config_path).start()
    with closing_client(first.client()) as client:
        assert put_values(client, items) == 5
    assert first.stop() == 0

    kept = lab.gateway(config_path, "--start-clean=0").start()
    with closing_client(kept.client()) as client:
        assert client.lookup(keys) == 5
        assert get_values(client, keys) == expected  # The RAM tier started empty: from the file tier (or its refill).
    assert kept.stop() == 0

    kept_by_default = lab.gateway(config_path, "--start-clean 0").start()
    with closing_client(kept_by_default.client()) as client:
        assert client.lookup(keys) == 5
    assert kept_by_default.stop() == 0

    cleaned = lab.gateway(config_path, "--start-clean=1").start()
    with closing_client(cleaned.client()) as client:
        assert client.lookup(keys) == 0
        assert get_values(client, keys) == []
    assert "emptied at start (--start-clean=1)" in cleaned.log()


# -- /dev/shm sizing, on a real small tmpfs ------------------------------------


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_mb: int) -> Iterator[bool]:
    """A tmpfs of ``size_mb`` at ``directory``; yields False if mounting is not permitted."""
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(directory)], capture_output=True
    )
    try:
        yield mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(directory)], check=True)


def test_ring_shrinks_to_fit_a_small_shm(lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm_dir = tmp_path / "shm"
    with small_tmpfs(shm_dir, 80) as mounted:
        config_path = lab.config(shm_dir=str(shm_dir), ring_mb=200, ring_mb_min=16, shm_reserve_mb=8)
        if mounted:
            gateway = lab.gateway(config_path).start()
            with closing_client(gateway.client()) as client:
                granted = client.hello.shm_bytes
                assert Path(client.hello.shm_path).parent == shm_dir
            log = gateway.log()
            gateway.stop()
        else:
            granted, log = _start_in_process(config_path, monkeypatch, free=80 * MIB, total=80 * MIB)
        assert granted == 72 * MIB, "80 MiB free less the 8 MiB reserve"
        assert "gateway ring of 200 MiB (gateway.ring_mb) does not fit" in log
        assert "80 MiB free of 80 MiB" in log and "using 72 MiB" in log
        assert "--shm-size=" in log and "--ipc=host" in log


def test_ring_below_the_minimum_refuses_to_start(lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm_dir = tmp_path / "shm"
    with small_tmpfs(shm_dir, 80) as mounted:
        config_path = lab.config(shm_dir=str(shm_dir), ring_mb=200, ring_mb_min=100)
        if mounted:
            gateway = lab.gateway(config_path)
            gateway.start(expect_ready=False)
            assert gateway.wait() == 2
            log = gateway.log()
        else:
            with pytest.raises(Exception, match="needs at least") as caught:
                _start_in_process(config_path, monkeypatch, free=80 * MIB, total=80 * MIB)
            log = str(caught.value)
        assert "needs at least 100 MiB (gateway.ring_mb_min)" in log and "80 MiB free of 80 MiB" in log
        assert "--shm-size=" in log and "--ipc=host" in log
        assert list(shm_dir.iterdir()) == []


def _start_in_process(config_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, total: int) -> tuple[int, str]:
    """Fallback where tmpfs cannot be mounted: the gateway in this process, told the free space."""
    import logging

    from kvharbor.gateway import server

    monkeypatch.setattr(server, "shm_space", lambda _directory: (free, total))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvharbor").addHandler(handler)
    gateway = server.Gateway(load_config(config_path, environ={}))
    try:
        gateway.start()
        assert gateway.segment is not None
        return gateway.segment.size, "\n".join(records)
    finally:
        gateway.stop()
        logging.getLogger("kvharbor").removeHandler(handler)


# -- the command line -----------------------------------------------------------


def run_cli(*args: str, console_script: bool = False) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("kvharbor")
    command = [str(script)] if console_script else [sys.executable, "-m", "kvharbor"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=30)


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway:\n  ring_mb: -5\n")
    for console_script in (False, True):
        result = run_cli("gateway", "--config", str(bad), console_script=console_script)
        assert result.returncode == 2
        assert result.stderr.startswith("kvharbor: error: ") and "gateway.ring_mb" in result.stderr
        assert "Traceback" not in result.stderr
    missing = run_cli("gateway", "--config", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "kvharbor: error: config file" in missing.stderr


def test_start_clean_takes_only_0_or_1(tmp_path: Path) -> None:
    result = run_cli("gateway", "--config", str(tmp_path / "x.yaml"), "--start-clean=yes")
    assert result.returncode == 2 and "expected 0 or 1" in result.stderr


def test_internal_options_stay_out_of_help() -> None:
    result = run_cli("gateway", "--help")
    assert result.returncode == 0
    assert "--start-clean 0|1" in result.stdout
    assert "--ready-fd" not in result.stdout and "--parent-fd" not in result.stdout


def test_share_hint_names_every_fix() -> None:
    for words in ("IPC namespace", "--ipc=host", "hostIPC: true", "/dev/shm"):
        assert words in SHARE_HINT
