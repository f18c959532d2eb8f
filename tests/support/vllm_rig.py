"""vLLM's real scheduler with kvharbor's connector in it, and no model: the connector's planning, step by step.

`SchedulerRig` builds the engine config from the tiny model, a KV cache of a
chosen number of blocks and vLLM's own `Scheduler`, which creates the
connector (scheduler role) the way an engine does. The connector's gateway
link is pointed at a real gateway (`RealGateway`). `step` runs one scheduling step, plays
the worker (saves land in the gateway, through a real client) and the model (one token for
every request whose prefill completes), and returns what the connector told
the workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvharbor.connector.vllm.connector as connector_module
from kvharbor.connector.link import CacheLink, Connect, RankSwitch
from kvharbor.connector.vllm.metadata import KVHarborMetadata
from kvharbor.connector.vllm.scheduler import SchedulerSide
from tests.gateway.gateway_harness import WAIT_S
from tests.support.real_gateway import RealGateway

BLOCK = 128
NEXT_TOKEN = 5
"""What the stand-in model always samples."""


@dataclass
class Step:
    output: SchedulerOutput
    meta: KVHarborMetadata
    finished: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    """The connector stats vLLM collected in this step (`SchedulerStats.kv_connector_stats`)."""

    def scheduled(self, req_id: str) -> int:
        return int(self.output.num_scheduled_tokens.get(req_id, 0))

    def new_request(self, req_id: str) -> Any:
        found = [r for r in self.output.scheduled_new_reqs if r.req_id == req_id]
        return found[0] if found else None


class SchedulerRig:
    def __init__(
        self,
        model: Path,
        *,
        num_blocks: int = 64,
        max_batched_tokens: int = 4096,
        prefix_caching: bool = True,
        engine: dict[str, Any] | None = None,
        sliding_window: int | None = None,
        hybrid: bool = False,
        mamba: bool = False,
        gateway: RealGateway,
    ) -> None:
        """``sliding_window``: the KV cache is one sliding-window group of that many tokens
        (vLLM's scheduler then frees blocks out of the window, and pads with its null block);
        with ``hybrid``, that group holds the odd layers only, beside a full-attention group
        of the even ones (vLLM's hybrid allocator, each group with blocks of its own). With
        ``mamba``, the even layers are a Mamba-type group instead (``--mamba-cache-mode align``,
        as vLLM's scheduler then plans its steps), beside a full-attention group of the odd ones."""
        extra = {"engine": engine or {}}
        transfer = KVTransferConfig(
            kv_connector="KVHarborConnector",
            kv_connector_module_path="kvharbor.connector.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
        args = EngineArgs(
            model=str(model),
            enforce_eager=True,
            dtype="float32",
            max_model_len=4096,
            max_num_batched_tokens=max_batched_tokens,
            enable_prefix_caching=prefix_caching,
            kv_transfer_config=transfer,
        )
        self.vllm_config = args.create_engine_config()
        assert self.vllm_config.cache_config.block_size == BLOCK
        if mamba:
            self.vllm_config.cache_config.mamba_cache_mode = "align"
            self.vllm_config.scheduler_config.watermark = 0.02  # int(0.02 x 64) = 1 block of reserve.
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
        shape: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
        full = FullAttentionSpec(**shape)
        spec: AttentionSpec = (
            full if sliding_window is None else SlidingWindowSpec(**shape, sliding_window=sliding_window)
        )
        groups = (
            [KVCacheGroupSpec(layers[0::2], full), KVCacheGroupSpec(layers[1::2], spec)]
            if hybrid
            else [KVCacheGroupSpec(layers, spec)]
        )
        if mamba:
            states = MambaSpec(
                block_size=BLOCK, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.float32, torch.float32),
                mamba_cache_mode="align",
            )  # fmt: skip
            mixers = [f"model.layers.{i}.linear_attn" for i in range(0, 4, 2)]
            groups = [KVCacheGroupSpec(mixers, states), KVCacheGroupSpec(layers[1::2], full)]
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.gateway = gateway

        def link(config: Any, name: str, connect: Connect | None = None) -> CacheLink:
            # Not the connector's own connect (it would start an embedded gateway): this test's.
            return CacheLink(config, name, connect=self.gateway.connect, switch=RankSwitch())

        # The connector vLLM builds here talks to this test's gateway.
        with mock.patch.object(connector_module, "CacheLink", link):
            self.scheduler = Scheduler(
                self.vllm_config,
                self.kv_cache_config,
                StructuredOutputManager(self.vllm_config),
                block_size=BLOCK,
                log_stats=True,
            )
        connector = self.scheduler.connector
        assert connector is not None
        side = connector._scheduler  # type: ignore[attr-defined]
        assert isinstance(side, SchedulerSide)
        self.side = side
        side.planner = None  # Always load: the load-or-recompute choice has its own tests.
        self.requests: dict[str, Request] = {}
        self.failed_loads: set[str] = set()
        """Requests a worker reported load errors for: their chunks are planned for saving
        again (the gateway skips those still stored); any other second save is a bug."""
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)

    @property
    def layout(self) -> Any:
        return self.side.layout

    def keys(self, tokens: list[int], salt: str | None = None) -> list[bytes]:
        """Rank 0's chunk keys of ``tokens``, as the connector computes them."""
        return [bytes(k) for k in self.layout.keys(tokens, salt)[0]]

    def hold(self, keys: list[bytes]) -> int:
        """Store chunks under ``keys`` as a worker of this layout would: values of its chunk
        size, under its fingerprint; returns how many were stored (see `RealGateway.hold`)."""
        return self.gateway.hold(keys, bytes(self.layout.chunk_bytes), fingerprint=self.layout.digests[0])

    def state_keys(self, tokens: list[int]) -> list[bytes]:
        """Rank 0's keys of the states at the chunk ends of ``tokens`` (a Mamba-type rig)."""
        return [bytes(k) for k in self.layout.state_keys(tokens, None)[0]]

    def hold_states(self, keys: list[bytes]) -> int:
        """Store states under ``keys`` as a worker of this layout would (`hold`)."""
        return self.gateway.hold(keys, bytes(self.layout.state_bytes), fingerprint=self.layout.state_digests[0])

    def request(self, req_id: str, tokens: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
        return Request(
            req_id,
            list(tokens),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            None,
            cache_salt=salt,
            block_hasher=self._hasher,
        )

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
        request = self.request(req_id, tokens, max_tokens, salt)
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def step(
        self,
        load_errors: Callable[[KVHarborMetadata], set[int]] | None = None,
        workers: Callable[[KVHarborMetadata], list[KVConnectorOutput]] | None = None,
    ) -> Step:
        """One step; ``load_errors(meta)``: the blocks of the step's loads the worker then
        reports it could not load; ``workers(meta)``: what each worker's connector reports in
        it instead (nothing by default), combined as vLLM's executor combines them
        (`KVOutputAggregator`)."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, KVHarborMetadata)
        failed = load_errors(meta) if load_errors is not None else set()
        for save in meta.saves if self.gateway.serving else []:  # The worker's part: the chunks land.
            keys = [bytes(key) for key in save.keys[0]]
            stored = self.hold(keys)
            assert stored == len(keys) or save.request_id in self.failed_loads, "a chunk is saved a second time"
            if save.state is not None:
                self.hold_states([bytes(save.state.keys[0][0])])
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.requests[req_id]
            # num_computed_tokens is already advanced past this step's tokens.
            sampled.append([NEXT_TOKEN] if request.num_computed_tokens >= request.num_tokens else [])
        # As a worker reports: an asynchronous load by request (failed when one of its blocks
        # is named), a synchronous one by its failed blocks.
        received = {load.request_id for load in meta.loads if load.asynchronous}
        failed_loads = {
            load.request_id
            for load in meta.loads
            if load.asynchronous and failed & {b for ids in load.block_ids for b in ids}
        }
        failed_blocks = {b for load in meta.loads if not load.asynchronous for ids in load.block_ids for b in ids}
        report = KVConnectorOutput(
            finished_recving=received or None, failed_recving=failed_loads, invalid_block_ids=failed & failed_blocks
        )
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=None if report.is_empty() else report,
        )
        if workers is not None:
            reports = workers(meta)
            per_worker = [dataclasses.replace(runner, kv_connector_output=report) for report in reports]
            combined = KVOutputAggregator(len(reports)).aggregate(list(per_worker))
            assert combined is not None
            runner = combined
        reported = runner.kv_connector_output.invalid_block_ids if runner.kv_connector_output else set()
        self.failed_loads.update(
            load.request_id for load in meta.loads if reported & {b for ids in load.block_ids for b in ids}
        )
        self.failed_loads.update(runner.kv_connector_output.failed_recving if runner.kv_connector_output else ())
        finished = []
        stats: dict[str, float] = {}
        for outputs in self.scheduler.update_from_output(output, runner).values():
            finished += [o.request_id for o in outputs.outputs if o.finish_reason is not None]
            if outputs.scheduler_stats is not None and outputs.scheduler_stats.kv_connector_stats:
                stats = dict(outputs.scheduler_stats.kv_connector_stats)
        return Step(output, meta, finished, stats)

    def run(self, max_steps: int = 200) -> list[Step]:
        """Step until every request has finished."""
        steps = []
        while self.scheduler.has_unfinished_requests():
            steps.append(self.step())
            assert len(steps) <= max_steps, "the scheduler did not finish"
        return steps

    @staticmethod
    def total(steps: list[Step], name: str) -> float:
        """A connector stat summed over steps, as vLLM's stats loggers see it."""
        return sum(step.stats.get(name, 0) for step in steps)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def wait_read_back(self, req_id: str) -> None:
        """Wait (bounded) for the read-back of ``req_id``'s stored chunks to finish."""
        job = self.side._requests[req_id].verification
        assert job is not None, f"{req_id}: no read-back was started"
        assert job.done.wait(WAIT_S), f"{req_id}: read-back not finished within {WAIT_S} s"
