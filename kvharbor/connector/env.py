"""The environment variables that turn kvharbor on inside an engine (vLLM, SGLang)."""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_ENABLE = "KVHARBOR"
_OFF = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, environ: Mapping[str, str] | None = None, default: bool = False) -> bool:
    """Whether the variable ``name`` is on: unset or empty is ``default``; 0, false, no, off are off."""
    value = (environ if environ is not None else os.environ).get(name, "").strip().lower()
    if not value:
        return default
    return value not in _OFF


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``KVHARBOR=1``: the engine's cache plugin turns kvharbor on."""
    return env_flag(ENV_ENABLE, environ)
