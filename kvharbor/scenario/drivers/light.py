"""The lightweight engine: vLLM's connector code paths, driven without vLLM, on synthetic KV.

A `LightEngine` is one engine process's connector as vLLM would hold it: the
scheduler half (`SchedulerSide`: the batched lookup, the hit bound, the read-back
of chunks outside RAM, the save plan) over its own `CacheLink`, and per rank the
worker's load and save links, all sharing one `RankSwitch` (a restarted engine
gets a new one, as a new process would). Each `request` is one prompt's life in
a vLLM step: admission (`get_num_new_matched_tokens`, idle steps while a
read-back runs), allocation, the step's metadata (loads and saves), the loads
compared byte for byte with `chunk_value`, a failed load reported back
(`observe_load_errors`) and its chunks saved again, then `request_finished`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvharbor.cache.keys import namespace_tag
from kvharbor.config import Config
from kvharbor.connector.link import CacheLink, RankSwitch
from kvharbor.connector.verifier import Verifier
from kvharbor.connector.vllm.scheduler import SchedulerSide
from kvharbor.gateway import embedded
from kvharbor.gateway.client import GatewayClient
from kvharbor.scenario.drivers.synthetic import chunk_value, synthetic_layout
from kvharbor.scenario.schema import EngineSetup
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.scenario")

ADMISSION_SLACK_S = 10.0
"""Beyond engine.verify_wait_ms, how long admission may take before the driver calls it a hang."""


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    name: str
    prompt_tokens: int
    cached_tokens: int
    """What vLLM would report in usage.prompt_tokens_details: the tokens restored from kvharbor."""
    bound_tokens: int
    """The most a prompt of this length can hit: min(floor(N / chunk) x chunk, the last block before N)."""
    promised_tokens: int
    wrong_bytes: int
    """Bytes handed to the engine that differ from what was stored under their key."""
    completed: bool
    output: str | None = None
    """The text the engine generated (greedy); None from an engine that generates none (this one)."""


@dataclass(frozen=True, slots=True)
class _Req:
    """What the scheduler half reads of a vLLM request."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class _Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


@dataclass(frozen=True, slots=True)
class _NewReq:
    req_id: str
    block_ids: tuple[list[int]]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class _CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Output:
    """What `SchedulerSide.build_meta` reads of vLLM's SchedulerOutput."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_new_reqs: list[_NewReq] = field(default_factory=list)
    scheduled_cached_reqs: _CachedReqs = field(default_factory=_CachedReqs)


class LightEngine:
    def __init__(self, config: Config, setup: EngineSetup, name: str) -> None:
        self.config = config
        self.setup = setup
        self.layout = synthetic_layout(setup, config)
        self.switch = RankSwitch()
        connect = partial(_connect, layouts=self.layout.fingerprints, release=setup.release)
        self.link = CacheLink(config, f"{name} scheduler", connect, self.switch)
        verifier = Verifier(
            CacheLink(config, f"{name} verify", connect, self.switch), self.layout.digests, self.layout.chunk_bytes
        )
        self.scheduler = SchedulerSide(self.layout, config, self.link, None, verifier)
        self.loads = [CacheLink(config, f"{name} rank {r} load", connect, self.switch) for r in range(setup.tp_size)]
        self.saves = [CacheLink(config, f"{name} rank {r} save", connect, self.switch) for r in range(setup.tp_size)]
        self._namespace = namespace_tag(setup.key_namespace)
        self._ids = itertools.count()
        self._next_block = 1  # Block 0 is vLLM's null block (`chunks.NULL_BLOCK`): never a request's.
        self.link.start()
        verifier.link.start()
        for rank, link in enumerate(self.loads):
            if link.start():
                _log.info(
                    # The worker's line, word for word: `kvharbor doctor --engine-log` looks for it.
                    "kvharbor: %d cache tensors registered (rank %d, page %d B, %.2f MiB per %d-token chunk; "
                    "layout %s)",
                    setup.layers, rank, self.layout.groups[0].page_bytes, self.layout.chunk_bytes / 2**20,
                    setup.chunk_size, self.layout.fingerprints[rank].short(),
                )  # fmt: skip

    @property
    def cache_off(self) -> bool:
        return self.switch.is_off

    @property
    def off_reason(self) -> str:
        return self.switch.reason

    def request(self, name: str, token_ids: Sequence[int], salt: str | None) -> RequestOutcome:
        layout = self.layout
        req = _Req(f"{name}-{next(self._ids)}", list(token_ids), salt)
        n = req.num_tokens
        bound = min(layout.max_hit_tokens(n), ((n - 1) // layout.block_size) * layout.block_size)
        external = self._admit(req)
        blocks = list(range(self._next_block, self._next_block + -(-n // layout.block_size)))
        self._next_block += len(blocks)
        if external:
            self.scheduler.update_state_after_alloc(req, _Blocks(blocks), external)
        # As vLLM schedules it: the loaded tokens count as computed, the rest is this step's.
        meta = self.scheduler.build_meta(
            _Output({req.request_id: n - external}, [_NewReq(req.request_id, (blocks,), external)])
        )
        cached, wrong = external, 0
        for load in meta.loads:
            loaded, bad = self._load(load.keys)
            wrong += bad
            if loaded < len(load.keys[0]):  # vLLM recomputes from the first block not loaded.
                failed = load.block_ids[0][max(0, loaded * layout.blocks_per_chunk - load.skip_blocks) :]
                cached = min(cached, max(0, loaded * layout.chunk_size - load.skip_blocks * layout.block_size))
                self.scheduler.observe_load_errors(set(failed))
                meta.saves.extend(
                    self.scheduler.build_meta(
                        _Output(scheduled_cached_reqs=_CachedReqs([req.request_id], [None], [n]))
                    ).saves
                )
        for save in meta.saves:
            self._save(save.keys)
        self.scheduler.request_finished(req)
        return RequestOutcome(name, n, cached, bound, external, wrong, completed=True)

    def close(self) -> None:
        self.scheduler.close()
        for link in (*self.loads, *self.saves):
            link.close()

    # -- internals ---------------------------------------------------------------

    def _admit(self, req: _Req) -> int:
        """Admission as vLLM asks it: again each step while a read-back is under way (an idle step between)."""
        deadline = time.monotonic() + self.config.engine.verify_wait_ms / 1000 + ADMISSION_SLACK_S
        while True:
            external, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            if external is not None:
                return external
            if time.monotonic() > deadline:
                raise RuntimeError(f"light engine: admission of {req.request_id} never settled")
            self.scheduler.build_meta(_Output())  # An idle step: it waits on the read-back.

    def _load(self, keys: Sequence[Sequence[bytes]]) -> tuple[int, int]:
        """Load every rank's share; (chunks every rank loaded, wrong bytes seen)."""
        size = self.layout.chunk_bytes
        wrong = 0
        loaded = len(keys[0])
        for rank, rank_keys in enumerate(keys):

            def sink(i: int, view: memoryview, rank: int = rank, rank_keys: Sequence[bytes] = rank_keys) -> None:
                nonlocal wrong
                expected = chunk_value(rank, rank_keys[i], size)
                if view.nbytes != size or bytes(view) != expected:
                    wrong += max(1, sum(a != b for a, b in zip(bytes(view), expected, strict=False)))

            got = self.loads[rank].load(self.layout.digests[rank], list(rank_keys), sink)
            loaded = min(loaded, got)
        return loaded, wrong

    def _save(self, keys: Sequence[Sequence[bytes]]) -> None:
        size = self.layout.chunk_bytes
        for rank, rank_keys in enumerate(keys):
            items = [(bytes(key), size) for key in rank_keys]

            def fill(i: int, view: memoryview, rank: int = rank, items: list[tuple[bytes, int]] = items) -> None:
                view[:] = chunk_value(rank, items[i][0], size)

            self.saves[rank].store(self.layout.digests[rank], items, fill, namespace=self._namespace)


def _connect(config: Config, client_name: str, layouts: Sequence[Any], release: str | None) -> GatewayClient:
    """The connector's connect; ``release``: speak as another release's engine would."""
    if release is None:
        return embedded.connect(config, client_name, layouts=layouts)
    return GatewayClient.connect(config.gateway, client_name, release=release, layouts=layouts)
