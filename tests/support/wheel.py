"""The wheel under test: the one CI built (``$KVHARBOR_WHEEL``, from ``make wheel``), else one
built here from the checkout the way the README's install line says (``pip wheel --no-deps .``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_ENV = "KVHARBOR_WHEEL"
"""Set by .ci/run to the wheel it built into dist/; without it a wheel is built."""
BUILD_TIMEOUT_S = 300


def kvharbor_wheel(directory: Path) -> Path:
    """``$KVHARBOR_WHEEL``, or a wheel of the checkout built into ``directory``."""
    given = os.environ.get(WHEEL_ENV)
    if given:
        return Path(given)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT), "-w", str(directory)]
    subprocess.run(cmd, check=True, timeout=BUILD_TIMEOUT_S, cwd=directory)
    (built,) = directory.glob("kvharbor-*.whl")
    return built
