"""``kvharbor demo`` end to end: the README's first command must show a restart hit, and say so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_harness import REPO

pytestmark = pytest.mark.e2e


def test_the_demo_shows_a_restart_hit(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "kvharbor", "demo", "--workdir", str(tmp_path / "demo"), "--prompt-tokens", "1200"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert step in out
    summary = re.search(r"restart hit: (\d+) of (\d+) prompt tokens restored from kvharbor; TTFT ([\d.]+) s", out)
    assert summary, out
    assert (int(summary[1]), int(summary[2])) == (1024, 1200)  # 4 whole chunks of 256
    assert re.search(r"kvharbor restored 4 chunks", out)
    assert (tmp_path / "demo" / "model" / "config.json").exists()
