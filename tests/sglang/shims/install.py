"""Put the stand-ins (tests/sglang/shims/modules) on ``sys.path``; see this package's docstring."""

from __future__ import annotations

import sys
from pathlib import Path

MODULES = Path(__file__).parent / "modules"


def install() -> None:
    """Make ``import sglang...`` work on this CPU machine; idempotent."""
    if str(MODULES) in sys.path:
        return
    # transformers asks once (cached) whether torchvision is installed and then imports its
    # video helpers: ask before the stand-in is importable, so that the answer stays "no".
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    sys.path.insert(0, str(MODULES))
