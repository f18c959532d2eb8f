"""`KVHarborConnector`: kvharbor as a vLLM KV connector (both roles).

vLLM builds one instance in the scheduler process (``role=SCHEDULER``) and one
in every worker (``role=WORKER``); each delegates to its half
(`SchedulerSide`, `WorkerSide`). Both build the same `VllmLayout` from the
engine's config, so the keys the scheduler looks up are the keys the workers
store under.

Enable it with ``KVHARBOR=1`` (see `plugin`) or explicitly::

    --kv-transfer-config '{"kv_connector": "KVHarborConnector",
        "kv_connector_module_path": "kvharbor.connector.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

A model whose KV cache the connector cannot exchange (`ConnectorRefusal`: a cache
group other than full attention, a chunk that is not whole blocks) is refused at
start when the config was given explicitly. Under ``KVHARBOR=1`` alone the engine
starts and the connector stays off: both halves are absent (``_scheduler`` and
``_worker`` None), every call answers as an empty cache, the scheduler's log says
why once and ``vllm:kvharbor_cache_off`` is 1. What only a worker sees (the tensors
vLLM registers) is handled the same way there: the worker stays off
(`WorkerSide.stay_off`: restores fail and are recomputed, nothing is stored) and says
why, and the scheduler stops planning on its next report.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvharbor.config import ConfigError
from kvharbor.connector.link import CacheLink
from kvharbor.connector.ranks import RankAgreement, RankGroup, SoleRank, TorchRankGroup
from kvharbor.connector.verifier import Verifier
from kvharbor.connector.vllm import compat, handoff
from kvharbor.connector.vllm.costs import load_planner
from kvharbor.connector.vllm.layout import ConnectorRefusal, build_layout, smallest_window
from kvharbor.connector.vllm.metadata import KVHarborMetadata
from kvharbor.connector.vllm.plugin import activated_by_env
from kvharbor.connector.vllm.scheduler import SchedulerSide
from kvharbor.connector.vllm.settings import config_from_extra
from kvharbor.connector.vllm.stats import KVHarborPromMetrics, KVHarborStats, empty
from kvharbor.connector.vllm.worker import WorkerSide
from kvharbor.gateway import embedded
from kvharbor.telemetry.log import attach_to_engine_log, get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_log = get_logger("kvharbor.connector.vllm")


class KVHarborConnector(KVConnectorBase_V1, SupportsHMA):
    """Both roles; `SupportsHMA`: vLLM keeps its hybrid allocator on, so every KV cache group
    (full attention and sliding window) has blocks of its own (`chunks.GroupBlocks`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        attach_to_engine_log()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "vLLM builds a connector only with a kv_transfer_config"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._engine_id = str(transfer.engine_id)
        """Shared by both roles of one engine (`handoff`)."""
        self.off_reason = ""
        """Why the connector stays off for this engine (`ConnectorRefusal` under ``KVHARBOR=1``)."""
        self._activated_by_env = activated_by_env(transfer.kv_connector_extra_config)
        """Enabled by ``KVHARBOR=1`` alone: a refusal then leaves the cache off, not the engine."""
        try:
            self.config = config_from_extra(transfer.kv_connector_extra_config)
            self.layout = build_layout(vllm_config, kv_cache_config, self.config)
        except ConnectorRefusal as err:
            if not self._activated_by_env:
                raise RuntimeError(
                    f"kvharbor: the connector refuses to start: {err}. Named in --kv-transfer-config, it refuses "
                    "rather than silently cache nothing: run this model without it (with KVHARBOR=1 alone the "
                    "engine would start without the external cache)"
                ) from None
            self.off_reason = str(err)
            if role == KVConnectorRole.SCHEDULER:  # One line per engine: the workers' say the same.
                _say_cannot_serve(err)
            return
        except ConfigError as err:
            raise RuntimeError(f"kvharbor: the connector refuses to start: {err}") from None
        if role == KVConnectorRole.SCHEDULER:
            self._insist_on_recompute(transfer)
            name = f"vllm-scheduler pid {os.getpid()}"
            # The scheduler looks up every rank's keys: it registers every rank's layout.
            connect = partial(embedded.connect, layouts=self.layout.fingerprints)
            link = CacheLink(self.config, name, connect=connect)
            # Its own connection: a long read-back must not hold up the lookups of other requests.
            verifier = Verifier(
                CacheLink(self.config, name + " verify", connect=connect), self.layout.digests, self.layout.chunk_bytes
            )
            self._scheduler = SchedulerSide(
                self.layout,
                self.config,
                link,
                load_planner(vllm_config, self.layout, self.config.engine),
                verifier,
                asynchronous_loads=len(self.layout.groups) > 1 and compat.reports_failed_loads(),
            )
            link.start()  # Connect now, as the workers do: not in the first request's path.
            verifier.link.start()  # Likewise: a first read-back must not wait for a connection.
            _log.info(
                "kvharbor: connector on (scheduler): chunk %d tokens = %d blocks, %d rank(s), namespace %s",
                self.layout.chunk_size, self.layout.blocks_per_chunk, self.layout.ranks,
                self.config.engine.key_namespace,
            )  # fmt: skip
            if self.layout.chunk_size != self.config.engine.chunk_size:
                window = smallest_window(self.layout.groups)
                _log.info(
                    "kvharbor: engine.chunk_size is unset: chunks of %d tokens (whole %d-token blocks of vLLM%s; "
                    "set engine.chunk_size to choose another multiple)",
                    self.layout.chunk_size, self.layout.block_size,
                    "" if window is None else f", within the sliding window of {window} tokens",
                )  # fmt: skip
            for group in self.layout.groups:  # One line per cache group, as vLLM hands them over.
                _log.info(
                    "kvharbor: group %d: %s, layers %s .. %s",
                    group.index, group.descriptor, group.layer_names[0], group.layer_names[-1],
                )  # fmt: skip
        else:
            rank = self.layout.rank_index(*_worker_ranks())
            name = f"vllm-worker rank {rank} pid {os.getpid()}"
            connect = partial(embedded.connect, layouts=(self.layout.fingerprints[rank],))
            load_link = CacheLink(self.config, name + " load", connect=connect)
            self._worker = WorkerSide(
                self.layout, self.config, load_link, CacheLink(self.config, name + " save", connect=connect), rank,
                RankAgreement(_tensor_parallel_group(), load_link.switch),
            )  # fmt: skip
            handoff.register(self._engine_id, self._worker)

    @staticmethod
    def _insist_on_recompute(transfer: Any) -> None:
        """A chunk that cannot be loaded must be recomputed, never fail the request."""
        if getattr(transfer, "kv_load_failure_policy", "recompute") == "recompute":
            return
        transfer.kv_load_failure_policy = "recompute"
        _log.warning(
            "kvharbor: kv_load_failure_policy 'fail' changed to 'recompute': a chunk the cache cannot "
            "deliver is recomputed, it never fails a request"
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # A best-effort cache: a dropped save is only a future miss.

    # -- scheduler role ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The groups an asynchronous load fills (vLLM leaves their new blocks unzeroed): every
        group; a load restores each group's blocks of its chunks, and a state's."""
        return tuple(group.index for group in self.layout.groups) if self._scheduler is not None else ()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVHarborMetadata()
        meta = self._scheduler.build_meta(scheduler_output)
        handoff.hand_over(self._engine_id, meta)  # This engine's worker, where it runs on this thread.
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this one, not `request_finished`, for a connector with `SupportsHMA`."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[Any]:
        return ()

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a worker's saves are not yet counted, so that
        ``vllm:kvharbor_stored_chunks`` includes the last commit (and a draining
        shutdown waits for it)."""
        return self._scheduler is not None and self._scheduler.saves_pending

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' stats of a step: what the load-or-recompute choice learns from."""
        if self._scheduler is not None:
            self._scheduler.observe(getattr(connector_output, "kv_connector_stats", None))
            self._scheduler.observe_load_errors(getattr(connector_output, "invalid_block_ids", None) or set())
            self._scheduler.observe_failed_loads(getattr(connector_output, "failed_recving", None) or set())

    # -- worker role -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is None:
            return
        try:
            self._worker.register(kv_caches, int(self._kv_cache_config.num_blocks))
        except ConnectorRefusal as err:
            if not self._activated_by_env:
                raise RuntimeError(f"kvharbor: the connector refuses to start: {err}") from None
            # What only the registered tensors show: under KVHARBOR=1 alone the cache is off
            # on this rank for good; the scheduler learns it from the next step's stats.
            self.off_reason = str(err)
            self._worker.stay_off(self.off_reason)
            _say_cannot_serve(err)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's first call of a step to a worker: the step's restores start here unless the
        scheduler already started them (`handoff`); vLLM's first model runner makes this
        call before it prepares the step's inputs. (Preempted requests need nothing: a save
        takes its pages within the step that computed them.)"""
        if self._worker is not None and isinstance(kv_connector_metadata, KVHarborMetadata):
            self._worker.prepare_load(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHarborMetadata)
        self._worker.load(meta)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVHarborMetadata):
            self._worker.begin_step(connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """CPU: loads finish in `start_load_kv`. GPU: the engine's stream waits for this
        layer's restores (they run on the connector's streams)."""
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """CPU: saves copy every layer at once in `wait_for_save`. GPU: this layer's pages
        of the step's saved chunks are gathered now, behind the forward pass."""
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHarborMetadata)
        self._worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM 0.32 (0.26 has no asynchronous loads of ours, and asks `get_finished`, which
        answers none): the asynchronous loads done since the last call, and which of them fell
        short (vLLM recomputes those). Saves never hold blocks back: nothing is sent."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        if self._worker is None:
            return KVConnectorTransferResults()
        received = self._worker.take_received()
        return KVConnectorTransferResults(finished_recving=received.done, failed_recving=received.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Both roles report: workers their loads and saves, the scheduler its lookups
        # and skipped requests; vLLM aggregates the two.
        side = self._worker if self._worker is not None else self._scheduler
        if side is None:
            return KVHarborStats(data={**empty(), "cache_off": 1}) if self.off_reason else None
        stats = KVHarborStats(data=side.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVHarborStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVHarborPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            handoff.unregister(self._engine_id, self._worker)
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _say_cannot_serve(err: ConnectorRefusal) -> None:
    _log.warning(
        "kvharbor: KVHARBOR=1, but the connector cannot serve this model, so the engine runs "
        "without the external KV cache: %s",
        err,
    )


def _worker_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline rank) of this worker."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.distributed.parallel_state import get_pp_group

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


def _tensor_parallel_group() -> RankGroup:
    """The ranks this worker agrees with each step: its tensor-parallel group, on the CPU."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return SoleRank() if group.world_size == 1 else TorchRankGroup(group.cpu_group)
