"""`handoff`: a step's loads reach the engine's own worker from the scheduler only where
both run on one thread (vLLM's uni-process executor)."""

from __future__ import annotations

import threading

from kvharbor.connector.vllm import handoff
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata

STEP = KVHarborMetadata(loads=[ChunkTransfer(request_id="r", keys=[[b"k" * 16]], block_ids=[[1, 2]])])


class Worker:
    def __init__(self) -> None:
        self.prepared: list[KVHarborMetadata] = []

    def prepare_load(self, meta: KVHarborMetadata) -> None:
        self.prepared.append(meta)


def on_another_thread(engine_id: str) -> bool:
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(handoff.hand_over(engine_id, STEP)))
    thread.start()
    thread.join()
    return answer[0]


def test_the_step_reaches_the_worker_of_the_same_engine_on_the_same_thread() -> None:
    worker, other = Worker(), Worker()
    handoff.register("engine-a", worker)
    handoff.register("engine-b", other)
    try:
        assert handoff.hand_over("engine-a", STEP)
        assert worker.prepared == [STEP] and other.prepared == []
        assert not handoff.hand_over("engine-a", KVHarborMetadata())  # No loads: nothing to start.
        assert not on_another_thread("engine-a")  # A worker on another thread gets its step from vLLM.
        assert not handoff.hand_over("engine-c", STEP)  # Its worker runs in another process.
        assert worker.prepared == [STEP]
    finally:
        handoff.unregister("engine-a", worker)
        handoff.unregister("engine-b", other)
    assert not handoff.hand_over("engine-a", STEP)  # Shut down.


def test_unregistering_another_worker_leaves_the_registered_one() -> None:
    worker = Worker()
    handoff.register("engine-d", worker)
    try:
        handoff.unregister("engine-d", Worker())
        assert handoff.hand_over("engine-d", STEP) and worker.prepared == [STEP]
    finally:
        handoff.unregister("engine-d", worker)


def test_two_workers_under_one_engine_id_are_never_handed_a_step() -> None:
    """Two engines of one process given the same ``engine_id``: a scheduler's step could
    reach the other engine's worker, so neither gets steps from a scheduler."""
    first, second = Worker(), Worker()
    handoff.register("engine-e", first)
    handoff.register("engine-e", second)
    try:
        assert not handoff.hand_over("engine-e", STEP)
        handoff.unregister("engine-e", second)
        assert not handoff.hand_over("engine-e", STEP)  # Still one id of two engines.
        assert first.prepared == second.prepared == []
    finally:
        handoff.unregister("engine-e", first)
