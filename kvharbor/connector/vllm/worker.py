"""The worker half: restore planned chunks into the paged cache, save completed ones.

Loads run before the forward pass (they are planned as synchronous loads), one
batched gateway request per step, copied straight from shared memory into the
allocated blocks. A chunk that cannot be loaded (miss, corrupt, cache off)
reports its blocks as load errors, and vLLM recomputes them: a failed load
costs time, never a wrong token.

Saves copy each completed chunk's pages into shared memory at the end of the
step (the blocks may be reused by the next step) and hand the commit — the
storage write — to a background thread, so the storage write is off the
engine's critical path. Loads and saves use separate gateway connections so a
slow storage write never delays a load.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvharbor.config import Config
from kvharbor.connector.link import CacheLink
from kvharbor.connector.vllm.gpu import GpuPages, GpuWorkerPath, StepTimer
from kvharbor.connector.vllm.layout import ConnectorRefusal, VllmLayout
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.pages import PageCopier
from kvharbor.connector.vllm.stats import empty
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.connector.vllm")

SAVE_QUEUE_MAX = 64
"""Steps whose saves may wait for the storage at once; past it a step's saves are dropped."""


@dataclass(frozen=True, slots=True)
class _SaveJob:
    items: list[tuple[bytes, int]]
    fill: Callable[[int, memoryview], None]
    filled: threading.Event
    settle: Callable[[], None] | None = None
    """GPU: make the staged device-to-host copies and wait for them, before the commit."""
    done: Callable[[], None] | None = None
    """GPU: give the device staging back, whatever became of the store."""


class WorkerSide:
    def __init__(
        self, layout: VllmLayout, config: Config, load_link: CacheLink, save_link: CacheLink, rank: int
    ) -> None:
        self.layout = layout
        self.config = config
        self.rank = rank
        self.fingerprint = layout.digests[rank]
        self._load_link = load_link
        self._save_link = save_link
        self._copier: PageCopier | None = None
        self._gpu: GpuWorkerPath | None = None
        """The GPU data path (`gpu`), when the KV cache is on a CUDA device."""
        self._timer: StepTimer | None = None
        self._load_errors: set[int] = set()
        self._stats = empty()
        self._stats_lock = threading.Lock()
        self._saves: queue.Queue[_SaveJob | None] = queue.Queue(maxsize=SAVE_QUEUE_MAX)
        self._saver = threading.Thread(target=self._save_loop, name="kvharbor-saver", daemon=True)
        self._saver.start()

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        tensors = list(kv_caches.values())
        self._timer = StepTimer(tensors[0].device)
        if tensors[0].is_cuda:
            self._register_gpu(kv_caches, num_blocks)
            return
        self._copier = PageCopier(tensors, num_blocks)
        copier = self._copier
        self._check_chunk_bytes(copier.chunk_bytes(self.layout.blocks_per_chunk))
        chunk_mib = copier.chunk_bytes(self.layout.blocks_per_chunk) / 2**20
        _log.info(
            "kvharbor: %d cache tensors registered (rank %d, page %d B, %.2f MiB per %d-token chunk; layout %s)",
            len(kv_caches), self.rank, copier.page_bytes, chunk_mib, self.layout.chunk_size,
            self.layout.fingerprints[self.rank].short(),
        )  # fmt: skip
        # Connect now: an embedded gateway starts here, not in the first request's path.
        self._load_link.start()
        self._save_link.start()

    def _register_gpu(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        pages = GpuPages(list(kv_caches.values()), num_blocks, self.layout.blocks_per_chunk)
        self._check_chunk_bytes(pages.chunk_bytes)
        _log.info(
            "kvharbor: %d GPU cache tensors registered (rank %d, page %d B, %.2f MiB per %d-token chunk; layout %s)",
            len(kv_caches), self.rank, pages.page_bytes, pages.chunk_bytes / 2**20, self.layout.chunk_size,
            self.layout.fingerprints[self.rank].short(),
        )  # fmt: skip
        self._gpu = GpuWorkerPath(
            pages, list(kv_caches), self._load_link, self._save_link, self.rank, self.fingerprint, self._count
        )
        if self._load_link.start() and self._save_link.start():
            self._gpu.pin()

    def _check_chunk_bytes(self, registered: int) -> None:
        """The scheduler looks up values of `VllmLayout.chunk_bytes`: a worker whose chunks
        had another size would find every one of them a miss."""
        expected = self.layout.chunk_bytes
        if expected and registered != expected:
            raise ConnectorRefusal(
                f"the registered KV cache holds {registered} bytes per chunk where the KV cache config says "
                f"{expected} ({', '.join(g.descriptor for g in self.layout.groups)}); layers sharing a cache "
                "are not supported"
            )

    # -- steps (GPU and timing) --------------------------------------------------------

    def begin_step(self, meta: KVHarborMetadata) -> None:
        """The step's metadata is bound; its forward pass follows."""
        if self._gpu is not None:
            self._gpu.begin_step(meta)
        if self._timer is not None:
            if meta.step_flops > 0 and not meta.loads:
                self._timer.begin()
            else:
                self._timer.cancel()

    def wait_layer(self, layer_name: str) -> None:
        if self._gpu is not None:
            self._gpu.wait_layer(layer_name)

    def save_layer(self, layer_name: str) -> None:
        if self._gpu is not None:
            self._gpu.save_layer(layer_name)

    # -- loads -------------------------------------------------------------------

    def load(self, meta: KVHarborMetadata) -> None:
        """Restore the step's loads. A request whose load falls short keeps none of the
        step's saves (``meta.saves`` is this worker's copy: pickled to it, or, in the
        scheduler's process, built for this step and not read again)."""
        copier = self._copier
        if (copier is None and self._gpu is None) or not meta.loads:
            return
        started = time.perf_counter()
        failed: set[str] = set()
        for transfer in meta.loads:
            if self._gpu is not None:
                loaded_blocks = self._gpu.load(transfer)
            else:
                assert copier is not None
                loaded_blocks = self._load_one(copier, transfer)
            self._load_errors.update(transfer.block_ids[loaded_blocks:])
            self._count(load_errors=len(transfer.block_ids) - loaded_blocks)
            if loaded_blocks < len(transfer.block_ids):
                failed.add(transfer.request_id)
        self._count(loads=1, load_s=time.perf_counter() - started, cache_off=int(self._load_link.is_off))
        if failed:
            # This step computes their later chunks over blocks that did not load: that KV
            # is wrong and must not be stored. vLLM recomputes it, and the scheduler saves
            # it then (`SchedulerSide.observe_load_errors`).
            meta.saves = [save for save in meta.saves if save.request_id not in failed]

    def _load_one(self, copier: PageCopier, transfer: ChunkTransfer) -> int:
        """Load as many leading blocks of ``transfer`` as the cache holds; returns that count."""
        per_chunk = self.layout.blocks_per_chunk
        expected = copier.chunk_bytes(per_chunk)
        loaded = 0

        def sink(i: int, value: memoryview) -> None:
            nonlocal loaded
            if value.nbytes != expected or loaded != _blocks_before(i, per_chunk, transfer.skip_blocks):
                return  # Another layout's bytes, or a gap: load nothing more.
            first = transfer.skip_blocks if i == 0 else 0
            take = min(per_chunk - first, len(transfer.block_ids) - loaded)
            copier.scatter(value, per_chunk, first, transfer.block_ids[loaded : loaded + take])
            loaded += take
            self._count(loaded_chunks=1, loaded_bytes=value.nbytes)

        self._load_link.load(self.fingerprint, transfer.keys[self.rank], sink)
        assert 0 <= loaded <= len(transfer.block_ids)
        return loaded

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------

    def save(self, meta: KVHarborMetadata) -> None:
        """Copy this step's completed chunks into shared memory; the commit runs behind."""
        if self._timer is not None:
            if self._gpu is not None and self._gpu.stalled:
                self._timer.cancel()  # The forward waited for save staging: not a prefill sample.
            else:
                self._timer.end(meta.step_flops)
        if self._gpu is not None:
            self._save_gpu(self._gpu, meta)
            return
        copier = self._copier
        if copier is None or not meta.saves or self._save_link.is_off:
            return
        per_chunk = self.layout.blocks_per_chunk
        size = copier.chunk_bytes(per_chunk)
        items: list[tuple[bytes, int]] = []
        blocks: list[Sequence[int]] = []
        for transfer in meta.saves:
            for i, key in enumerate(transfer.keys[self.rank]):
                items.append((key, size))
                blocks.append(transfer.block_ids[i * per_chunk : (i + 1) * per_chunk])
        job = _SaveJob(items, lambda i, view: copier.gather(blocks[i], view), threading.Event())
        try:
            self._saves.put_nowait(job)
        except queue.Full:
            _log.warning("kvharbor: %d saves waiting for storage; this step's %d chunks are not saved",
                         SAVE_QUEUE_MAX, len(items))  # fmt: skip
            return
        # The pages must be copied before the step ends; the storage write need not.
        job.filled.wait(self.config.gateway.request_timeout_ms / 1000 * 2)

    def _save_gpu(self, gpu: GpuWorkerPath, meta: KVHarborMetadata) -> None:
        """The step's gathers are queued on the GPU; the saver thread copies them out
        and commits, behind the engine (the staging is the job's own)."""
        parts = gpu.end_step(meta)
        if parts is None:
            return
        size = gpu.pages.chunk_bytes
        job = _SaveJob([(k, size) for k in parts.keys], parts.fill, threading.Event(), parts.settle, parts.done)
        try:
            self._saves.put_nowait(job)
        except queue.Full:
            parts.done()
            _log.warning("kvharbor: %d saves waiting for storage; this step's %d chunks are not saved",
                         SAVE_QUEUE_MAX, len(parts.keys))  # fmt: skip

    def _save_loop(self) -> None:
        while (job := self._saves.get()) is not None:
            started = time.perf_counter()
            settle = job.settle

            def filled(job: _SaveJob = job, settle: Callable[[], None] | None = settle) -> None:
                if settle is not None:
                    settle()
                job.filled.set()

            try:
                stored = self._save_link.store(self.fingerprint, job.items, job.fill, on_filled=filled)
            finally:
                job.filled.set()
                if job.done is not None:
                    job.done()
            self._count(
                saves=1,
                save_s=time.perf_counter() - started,
                stored_chunks=stored,
                stored_bytes=stored * job.items[0][1],
                cache_off=int(self._save_link.is_off),
            )

    # -- stats and shutdown ----------------------------------------------------------

    def take_stats(self) -> dict[str, float]:
        with self._stats_lock:
            stats, self._stats = self._stats, empty()
        if self._timer is not None:
            stats["prefill_flops"], stats["prefill_s"] = self._timer.take()
        # Every step once off, not only in a step that moved data: once the cache is
        # off nothing moves, and the state must still reach the metrics.
        stats["cache_off"] = max(stats["cache_off"], int(self._load_link.is_off))
        return stats

    def close(self) -> None:
        self._saves.put(None)
        self._saver.join(timeout=self.config.gateway.request_timeout_ms / 1000 * 2)
        if self._gpu is not None:
            self._gpu.close()  # Unpin before the links unmap their shared memory.
        self._load_link.close()
        self._save_link.close()

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                if name == "cache_off":
                    self._stats[name] = max(self._stats[name], delta)
                else:
                    self._stats[name] = self._stats.get(name, 0) + delta


def _blocks_before(chunk: int, per_chunk: int, skip_blocks: int) -> int:
    """Blocks a transfer loads before its chunk ``chunk`` (the first chunk may be partial)."""
    return 0 if chunk == 0 else chunk * per_chunk - skip_blocks
