"""The kvharbor config of a vLLM engine: environment, then ``kv_connector_extra_config``.

``--kv-transfer-config '{"kv_connector": "KVHarborConnector", ...,
"kv_connector_extra_config": {"config_file": "/etc/kvharbor.yaml", "engine": {"chunk_size": 512}}}'``

The extra config holds ``config_file`` (else ``KVHARBOR_CONFIG``) and any
kvharbor config section (``engine``, ``gateway``, ``storage``, ...), merged on
top. Any other key is refused with its name: a typo must not silently run
with defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvharbor.config import Config, ConfigError, load_config

CONFIG_FILE_KEY = "config_file"
_SECTIONS = frozenset(Config.model_fields)


def config_from_extra(extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Config:
    """Raises `ConfigError` naming the bad key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _SECTIONS - {CONFIG_FILE_KEY})
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
            f"allowed: {CONFIG_FILE_KEY}, {', '.join(sorted(_SECTIONS))}"
        )
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"kv_connector_extra_config.{CONFIG_FILE_KEY} must be a path string, got {path!r}")
    return load_config(path, os.environ if environ is None else environ, overrides=extra)
