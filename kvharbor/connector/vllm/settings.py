"""The kvharbor config of a vLLM engine: environment, then ``kv_connector_extra_config``.

``--kv-transfer-config '{"kv_connector": "KVHarborConnector", ...,
"kv_connector_extra_config": {"config_file": "/etc/kvharbor.yaml", "engine": {"chunk_size": 512}}}'``

The extra config holds ``config_file`` (else ``KVHARBOR_CONFIG``) and any
kvharbor config section (``engine``, ``gateway``, ``storage``, ...), merged on
top (`kvharbor.connector.extra_config`), and the mark of a config ``KVHARBOR=1``
filled in (`kvharbor.connector.vllm.plugin.ACTIVATION_KEY`). Any other key is
refused with its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvharbor.config import Config
from kvharbor.connector.extra_config import CONFIG_FILE_KEY
from kvharbor.connector.extra_config import config_from_extra as _config_from_extra
from kvharbor.connector.vllm.plugin import ACTIVATION_KEY

__all__ = ["CONFIG_FILE_KEY", "config_from_extra"]


def config_from_extra(extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Config:
    """Raises `ConfigError` naming the bad key."""
    return _config_from_extra(extra, "kv_connector_extra_config", environ, engine_keys={ACTIVATION_KEY})
