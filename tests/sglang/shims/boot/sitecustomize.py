"""Every process of an engine the SGLang tests start (``PYTHONPATH`` names this folder) runs
with the test shims installed: SGLang spawns its scheduler, which imports SGLang anew."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # The checkout: ``tests`` is importable.

from tests.sglang.shims.install import install

install()
