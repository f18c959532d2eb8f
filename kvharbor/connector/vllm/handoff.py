"""A step's loads handed from the scheduler to its own engine's worker, where both run on
one thread of one process (vLLM's uni-process executor: one rank, the engine core calls
the scheduler and then the worker).

vLLM tells a worker its step's loads late: its second model runner (the default of vLLM
0.26 on a GPU) calls ``handle_preemptions``, ``bind_connector_metadata`` and
``start_load_kv`` together, after it has prepared the step's inputs (15-29 ms for a
130,000-token request on an H200). The scheduler knows them as soon as it has built the
step's metadata: a worker registered here for the same engine and thread starts them then
(`WorkerSide.prepare_load`), and their copies overlap the executor's call and that
preparation. A worker in another process (tensor parallel, the multi-process executor)
is not found here, and starts its loads at ``handle_preemptions``.
"""

from __future__ import annotations

import threading
from typing import Protocol

from kvharbor.connector.vllm.metadata import KVHarborMetadata


class Preparer(Protocol):
    def prepare_load(self, meta: KVHarborMetadata) -> None:
        """Start the step's loads now; the worker's ``start_load_kv`` waits for them."""


_lock = threading.Lock()
_workers: dict[str, tuple[int, Preparer]] = {}
"""Engine id -> (the thread the worker was registered on, the worker)."""
_shared_ids: set[str] = set()
"""Engine ids two workers of this process registered (a ``kv_transfer_config`` naming its
``engine_id``, given to two engines): whose step a scheduler's is cannot be told, so no
worker of such an id is handed steps (each gets its own from vLLM)."""


def register(engine_id: str, worker: Preparer) -> None:
    """``worker`` serves the engine ``engine_id`` on the calling thread (the engine core's)."""
    with _lock:
        held = _workers.get(engine_id)
        if engine_id in _shared_ids or (held is not None and held[1] is not worker):
            _shared_ids.add(engine_id)
            _workers.pop(engine_id, None)
            return
        _workers[engine_id] = (threading.get_ident(), worker)


def unregister(engine_id: str, worker: Preparer) -> None:
    with _lock:
        if _workers.get(engine_id, (0, None))[1] is worker:
            del _workers[engine_id]


def hand_over(engine_id: str, meta: KVHarborMetadata) -> bool:
    """Start ``meta``'s loads in the engine's worker if it runs here, on this thread (the
    next call it gets is this step's); False: no such worker."""
    if not meta.loads:
        return False
    with _lock:
        thread, worker = _workers.get(engine_id, (0, None))
    if worker is None or thread != threading.get_ident():
        return False
    worker.prepare_load(meta)
    return True
