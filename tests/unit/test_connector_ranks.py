"""Two tensor-parallel workers over one real gateway: they restore, report and save alike, and turn off together.

Each rank is a real `WorkerSide` with its own links and switch, as in two
processes; the ranks run their step on two threads. What stands in for
``torch.distributed`` is `ThreadGroup` (a minimum and a gather across the
threads); the real group runs in tests/e2e/test_e2e_tensor_parallel.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kvharbor.config import Config
from kvharbor.connector.link import CacheLink, RankSwitch
from kvharbor.connector.ranks import RankAgreement, SoleRank
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.worker import WorkerSide
from kvharbor.gateway.client import GatewayRefused
from kvharbor.gateway.protocol import ErrorCode
from tests.support.real_gateway import RealGateway
from tests.support.stand_ins import LAYERS, layout

RANKS = 2
NUM_BLOCKS = 16
OFF = "external KV cache turned off on this rank"
WAIT_S = 30
KEYS = [[bytes([16 * rank + i]) * 16 for i in range(3)] for rank in range(RANKS)]
"""Per rank, the keys of chunks 0..2 of request "r"."""
OTHER = [[bytes([100 + rank]) * 16] for rank in range(RANKS)]
"""Per rank, the key of the one chunk of request "other"."""
NEXT = [[bytes([200 + rank]) * 16] for rank in range(RANKS)]
"""Per rank, the key of request "r"'s chunk 3, computed in the step that restores chunks 0..2."""


class ThreadGroup:
    """``torch.distributed``'s minimum and gather, across threads (the ranks of this test)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=WAIT_S)
        self._slots: list[Any] = [None] * size
        self.collectives = 0
        """Collectives completed (counted once, by rank 0)."""

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # Nobody writes the next round's slot before everyone read this one.
        self.collectives += rank == 0
        return values


class _Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.size, self.rank = group, group.size, rank

    def min(self, values: Sequence[int]) -> list[int]:
        return [min(column) for column in zip(*self.group.exchange(self.rank, list(values)), strict=True)]

    def gather(self, text: str) -> list[str]:
        return [str(t) for t in self.group.exchange(self.rank, text)]


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    storage = torch.zeros(len(LAYERS), NUM_BLOCKS, 2, 128, 128)
    if seed is not None:
        storage.copy_(torch.randn(storage.shape, generator=torch.Generator().manual_seed(seed)))
    return dict(zip(LAYERS, storage.unbind(0), strict=True))


def workers(config: Config, group: ThreadGroup, kv: list[dict[str, torch.Tensor]]) -> list[WorkerSide]:
    """One `WorkerSide` per rank, each with the links and switch of its own process."""
    sides = []
    for rank in range(RANKS):
        switch = RankSwitch()
        side = WorkerSide(
            layout(**{"parallel_config.tensor_parallel_size": RANKS}),
            config,
            CacheLink(config, f"rank {rank} load", switch=switch),
            CacheLink(config, f"rank {rank} save", switch=switch),
            rank,
            RankAgreement(group.member(rank), switch),
        )
        side.register(kv[rank], NUM_BLOCKS)
        sides.append(side)
    return sides


def on_every_rank(sides: list[WorkerSide], step: Callable[[WorkerSide], None]) -> None:
    """``step`` on each rank at once, as the engine runs its workers."""
    with ThreadPoolExecutor(RANKS) as pool:
        for future in [pool.submit(step, side) for side in sides]:
            future.result(WAIT_S)


def chunks(keys: list[list[bytes]], blocks: list[int], request_id: str = "r") -> ChunkTransfer:
    return ChunkTransfer(request_id=request_id, keys=keys, block_ids=[blocks])


def save_now(side: WorkerSide, transfer: ChunkTransfer) -> None:
    """``side`` saves its shard of ``transfer``; the commit is done when this returns."""
    side.save(KVHarborMetadata(saves=[transfer]))
    side.close()


def step(loads: list[ChunkTransfer], saves: list[ChunkTransfer]) -> list[KVHarborMetadata]:
    """One step's metadata, a copy per rank (each worker process gets its own)."""
    return [KVHarborMetadata(loads=list(loads), saves=list(saves)) for _ in range(RANKS)]


def off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if OFF in r.getMessage()]


def test_a_restore_short_on_one_rank_is_short_on_every_rank(real_gateway: RealGateway) -> None:
    gateway, group = real_gateway, ThreadGroup(RANKS)
    source = [caches(seed=rank) for rank in range(RANKS)]
    writers = workers(gateway.config, group, source)
    save_now(writers[0], chunks(KEYS, [1, 2, 3, 4, 5, 6]))
    # Rank 1 has only chunk 0 (the rest evicted or damaged: a miss on that rank only).
    save_now(writers[1], chunks([k[:1] for k in KEYS], [1, 2]))
    assert gateway.holds(KEYS[0]) == 3 and gateway.holds(KEYS[1]) == 1

    target = [caches(seed=None) for _ in range(RANKS)]
    sides = workers(gateway.config, group, target)
    puts = gateway.puts
    # One step: restore r's 3 chunks; save r's chunk 3 (computed over them) and another request's chunk.
    metas = step([chunks(KEYS, [9, 10, 11, 12, 13, 14])], [chunks(NEXT, [1, 2]), chunks(OTHER, [3, 4], "other")])
    on_every_rank(sides, lambda side: side.load(metas[side.rank]))
    on_every_rank(sides, lambda side: side.save(metas[side.rank]))

    # Rank 0 restored all three chunks, rank 1 only chunk 0: both report chunks 1 and 2 for recompute.
    assert [side.take_load_errors() for side in sides] == [{11, 12, 13, 14}] * RANKS
    assert all(torch.equal(target[0][n][[9, 10, 11, 12, 13, 14]], source[0][n][1:7]) for n in LAYERS)
    # r's chunk 3 is saved by no rank; the other request's by both.
    assert [[s.request_id for s in meta.saves] for meta in metas] == [["other"]] * RANKS
    assert [side.take_stats()["cache_off"] for side in sides] == [0, 0]
    for side in sides:
        side.close()
    assert gateway.puts - puts == RANKS
    assert [gateway.holds(keys) for keys in OTHER + NEXT] == [1, 1, 0, 0]


def test_a_restore_short_on_one_rank_after_the_answer_is_short_on_every_rank(real_gateway: RealGateway) -> None:
    """Both ranks' gateways answered the restore in full and the forward pass ran over it; then
    rank 1 could not give back its held request's room after the copy (not counted): the ranks
    agree again after the forward pass, report the same blocks, and neither saves the
    request's chunk computed in that step, while the cache stays on."""
    gateway, group = real_gateway, ThreadGroup(RANKS)
    for writer in workers(gateway.config, group, [caches(seed=rank) for rank in range(RANKS)]):
        save_now(writer, chunks(KEYS, [1, 2, 3, 4, 5, 6]))
    sides = workers(gateway.config, group, [caches(seed=None) for _ in range(RANKS)])
    client = sides[1]._load_link._client
    assert client is not None

    def refuse(batch: Any) -> None:
        raise GatewayRefused(ErrorCode.BUSY, "busy")

    client.release = refuse  # type: ignore[method-assign]
    metas = step([chunks(KEYS, [9, 10, 11, 12, 13, 14])], [chunks(NEXT, [1, 2]), chunks(OTHER, [3, 4], "other")])
    on_every_rank(sides, lambda side: side.prepare_load(metas[side.rank]))
    on_every_rank(sides, lambda side: side.load(metas[side.rank]))
    assert [[s.request_id for s in meta.saves] for meta in metas] == [["r", "other"]] * RANKS
    on_every_rank(sides, lambda side: side.save(metas[side.rank]))
    assert [side.take_load_errors() for side in sides] == [set(range(9, 15))] * RANKS
    assert [side.take_stats()["cache_off"] for side in sides] == [0, 0]
    for side in sides:
        side.close()
    assert [gateway.holds(keys) for keys in OTHER + NEXT] == [1, 1, 0, 0]


def test_one_ranks_failure_turns_the_cache_off_on_every_rank_in_that_step(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gateway, group = real_gateway, ThreadGroup(RANKS)
    for writer in workers(gateway.config, group, [caches(seed=rank) for rank in range(RANKS)]):
        save_now(writer, chunks(KEYS, [1, 2, 3, 4, 5, 6]))
    sides = workers(gateway.config, group, [caches(seed=None) for _ in range(RANKS)])
    assert gateway.hang_up("rank 1 ") == 2  # Rank 1's load and save links lose the gateway.
    puts = gateway.puts
    metas = step([chunks(KEYS, [5, 6, 7, 8, 9, 10])], [chunks(OTHER, [1, 2], "other")])
    with caplog.at_level(logging.ERROR, "kvharbor"):
        on_every_rank(sides, lambda side: side.load(metas[side.rank]))
        on_every_rank(sides, lambda side: side.save(metas[side.rank]))
    assert [side.take_load_errors() for side in sides] == [set(range(5, 11))] * RANKS
    assert [side.take_stats()["cache_off"] for side in sides] == [1, 1]
    # Each rank says it once: rank 1 why its link failed, rank 0 that rank 1 turned it off first.
    lines = off_lines(caplog)
    assert len(lines) == RANKS, lines
    assert sum("rank 1 of 2 turned it off first (" in line for line in lines) == 1
    for side in sides:
        side.close()
    assert gateway.puts == puts  # Rank 0 saved nothing either.


def test_a_step_marked_cache_off_turns_every_rank_off_without_loads(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gateway, group = real_gateway, ThreadGroup(RANKS)
    sides = workers(gateway.config, group, [caches(seed=None) for _ in range(RANKS)])
    assert gateway.hang_up("rank 1 save") == 1
    with caplog.at_level(logging.ERROR, "kvharbor"):
        sides[1].save(KVHarborMetadata(saves=[chunks(OTHER, [1, 2], "other")]))  # Fails in the saver thread.
        idle = step([], [])
        on_every_rank(sides, lambda side: side.load(idle[side.rank]))
        assert group.collectives == 0  # A step with nothing to restore costs no collective ...
        assert [side.take_stats()["cache_off"] for side in sides] == [0, 1]
        marked = [KVHarborMetadata(cache_off="a worker reported it off") for _ in range(RANKS)]
        on_every_rank(sides, lambda side: side.load(marked[side.rank]))
    assert group.collectives == 2  # ... the marked one a minimum and, the first time off, a gather.
    assert [side.take_stats()["cache_off"] for side in sides] == [1, 1]
    lines = off_lines(caplog)
    assert len(lines) == RANKS and "rank 1 of 2 turned it off first (" in lines[1], lines
    for side in sides:
        side.close()


def test_a_group_of_one_drops_the_saves_behind_its_own_short_restore(real_gateway: RealGateway) -> None:
    gateway = real_gateway
    switch = RankSwitch()
    config = gateway.config
    side = WorkerSide(
        layout(), config, CacheLink(config, "load", switch=switch), CacheLink(config, "save", switch=switch), 0,
        RankAgreement(SoleRank(), switch),
    )  # fmt: skip
    side.register(caches(seed=None), NUM_BLOCKS)
    step = KVHarborMetadata(loads=[chunks(KEYS[:1], [1, 2])], saves=[chunks([[b"\x35" * 16]], [3, 4])])
    side.load(step)  # Nothing is stored: the restore falls short at once.
    assert side.take_load_errors() == {1, 2}
    assert step.saves == []
    side.close()
