"""vLLM plugin entry point: ``KVHARBOR=1`` turns the connector on.

vLLM runs `register` in each of its processes (entry point group
``vllm.general_plugins``). vLLM has no environment variable for a KV transfer
config, so `register` wraps ``EngineArgs.create_engine_config``: when the user
gave no ``--kv-transfer-config`` and ``KVHARBOR=1``, it fills one in. The
config built there travels to the engine core and the workers, so wrapping
it in the front-end process is enough. An explicit ``--kv-transfer-config``
always wins, and a log line says so.

The config ``KVHARBOR=1`` fills in is marked (`ACTIVATION_KEY` in its
``kv_connector_extra_config``), because activation decides what a model the
connector cannot serve does: with ``KVHARBOR=1`` alone the engine starts without
the cache and says so once (set across a fleet, the variable must not stop the
engines of models kvharbor cannot serve); with an explicit config naming the
connector it refuses to start (asked for by name, it never silently caches nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvharbor.connector.env import ENV_ENABLE, enabled
from kvharbor.connector.vllm.compat import SUPPORTED, version_supported, vllm_version
from kvharbor.connector.vllm.cpu_binding import RESERVED_ENV, keep_engine_cores
from kvharbor.telemetry.log import OnceLog, attach_to_engine_log, get_logger

__all__ = [
    "ACTIVATION_KEY",
    "ENV_ENABLE",
    "activated_by_env",
    "choose_transfer_config",
    "enabled",
    "register",
    "transfer_config",
]

CONNECTOR_NAME = "KVHarborConnector"
ACTIVATION_KEY = "activated_by"
"""The ``kv_connector_extra_config`` key that marks a config `transfer_config` filled in."""
ACTIVATED_BY_ENV = ENV_ENABLE + "=1"
CONNECTOR_MODULE = "kvharbor.connector.vllm.connector"

_log = get_logger("kvharbor.connector.vllm")
_once = OnceLog(_log)
_MARK = "__kvharbor_wrapped__"


def transfer_config() -> dict[str, Any]:
    """The KV transfer config that ``KVHARBOR=1`` stands for."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {ACTIVATION_KEY: ACTIVATED_BY_ENV},
    }


def activated_by_env(extra: Mapping[str, Any] | None) -> bool:
    """Whether a connector's ``kv_connector_extra_config`` is the one ``KVHARBOR=1`` filled in."""
    return extra is not None and extra.get(ACTIVATION_KEY) == ACTIVATED_BY_ENV


def choose_transfer_config(given: Any, environ: Mapping[str, str] | None = None) -> Any:
    """The KV transfer config an engine runs with: ``given`` whenever the user gave
    one (it always wins, and a line says so when KVHARBOR=1 asked for kvharbor),
    else kvharbor's when ``KVHARBOR=1``, else None."""
    if not enabled(environ):
        return given
    if given is None:
        from vllm.config import KVTransferConfig

        _once.say("on", "KVHARBOR=1: the kvharbor KV connector is on", level=logging.INFO)
        return KVTransferConfig(**transfer_config())
    name = getattr(given, "kv_connector", None) or (given.get("kv_connector") if isinstance(given, dict) else given)
    if name != CONNECTOR_NAME:
        _once.say(
            "explicit",
            f"KVHARBOR=1 but an explicit --kv-transfer-config ({name}) was given; it wins and "
            "kvharbor stays off. Remove it, or configure KVHarborConnector in it",
        )
    return given


def register() -> None:
    if not enabled():
        return
    attach_to_engine_log()
    if not version_supported():
        _once.say(
            "version",
            f"KVHARBOR=1 but vLLM {vllm_version()} is outside the supported range {SUPPORTED}; "
            "the external KV cache stays off",
        )
        return
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, _MARK, False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.kv_transfer_config = choose_transfer_config(self.kv_transfer_config)
        config = original(self, *args, **kwargs)
        if getattr(config.kv_transfer_config, "kv_connector", None) == CONNECTOR_NAME:
            reserved = keep_engine_cores(config)
            if reserved is not None:
                _once.say(
                    "cores",
                    f"vLLM's CPU backend: {RESERVED_ENV}={reserved}, the cores it reserves without a KV "
                    "connector (its extra one for a connector's threads would leave a small host none; "
                    "kvharbor's storage work runs in the gateway). Set it to override",
                    level=logging.INFO,
                )
        return config

    setattr(create_engine_config, _MARK, True)
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
