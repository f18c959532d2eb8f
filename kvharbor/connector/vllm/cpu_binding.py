"""On vLLM's CPU backend, the engine keeps the cores it has without a connector.

vLLM's CPU backend binds each worker's OpenMP threads to cores and reserves some for the
engine core and the API server (``VLLM_CPU_NUM_OF_RESERVED_CPU``; one per local rank by
default). Whenever a KV transfer config is set it reserves as many again, "for
nixl_connector under p/d case" (vLLM 0.32, ``utils/ompmultiprocessing.py``), and where the
host has no more CPUs than that (2 CPUs and one rank) it reserves none at all: the worker's
threads then take every CPU, the one the engine core's busy loop spins on included.
Measured on a 2-vCPU machine (``bench/serve.py``, 1 client, 64-token answers, the same
engine settings): time per output token 6.1 ms with kvharbor against 3.7 ms without a
connector; with vLLM's own reservation restored, 4.3 ms against 3.9 ms.

kvharbor needs no core of the worker's: its storage work runs in the gateway, a process of
its own that places itself on every CPU (`kvharbor.gateway.cpus`), and its worker threads
wait on the gateway. So `keep_engine_cores` sets the reservation vLLM makes without a
connector, before the engine core starts (it inherits the variable), unless the user has
set the reservation or bound the threads by hand: their setting wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
AUTO_BIND = "auto"
"""vLLM's default binding, the only one it reserves cores in."""


def keep_engine_cores(vllm_config: Any, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Set ``VLLM_CPU_NUM_OF_RESERVED_CPU`` in ``environ`` to the cores vLLM reserves
    without a connector (one per local rank), for an engine on vLLM's CPU backend whose
    threads vLLM binds itself; returns the number set, or None where nothing was changed
    (another backend, a binding or reservation the user set)."""
    if vllm_config.device_config.device_type != "cpu":
        return None
    if RESERVED_ENV in environ or environ.get(BIND_ENV, AUTO_BIND) != AUTO_BIND:
        return None
    reserved = int(vllm_config.parallel_config.local_world_size)
    if reserved < 1:
        raise ValueError(f"a local world size of {reserved} ranks")
    environ[RESERVED_ENV] = str(reserved)
    return reserved
