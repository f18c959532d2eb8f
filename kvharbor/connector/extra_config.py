"""A kvharbor config given inside an engine's own connector or backend config.

Both engines take a JSON object for their cache plugin (vLLM's
``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``).
kvharbor reads from it ``config_file`` (else ``KVHARBOR_CONFIG``) and any kvharbor
config section (``engine``, ``gateway``, ``storage``, ...), merged on top. Keys the
engine itself reads there are named by the caller and left alone; any other key is
refused with its name: a typo must not silently run with defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Set
from typing import Any

from kvharbor.config import Config, ConfigError, load_config

CONFIG_FILE_KEY = "config_file"
SECTIONS = frozenset(Config.model_fields)


def config_from_extra(
    extra: Mapping[str, Any] | None,
    where: str,
    environ: Mapping[str, str] | None = None,
    engine_keys: Set[str] = frozenset(),
) -> Config:
    """The config that ``extra`` (the engine option named ``where``) stands for; raises
    `ConfigError` naming the bad key. ``engine_keys``: keys of the engine's own, ignored."""
    extra = {key: value for key, value in (extra or {}).items() if key not in engine_keys}
    unknown = sorted(set(extra) - SECTIONS - {CONFIG_FILE_KEY})
    if unknown:
        allowed = [CONFIG_FILE_KEY, *sorted(SECTIONS), *sorted(engine_keys)]
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"{where}.{CONFIG_FILE_KEY} must be a path string, got {path!r}")
    return load_config(path, os.environ if environ is None else environ, overrides=extra)
