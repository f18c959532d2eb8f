"""The worker's one data path: chunks between the paged KV cache and the gateway.

One algorithm for a cache in host memory and one on a GPU, over a `copier.PageCopy`:

- **loads**: plan which blocks of which stored chunk go where (`chunks`),
  stage each chunk the gateway hands over, flush after every request of
  ``chunks_per_load`` chunks (``engine.load_batch_mb``), wait for a request's
  copies only once ``loads_queued_max`` requests are under way
  (`CacheLink.load_streamed`; ``engine.loads_in_flight_max`` on a GPU). A
  ``proceed`` policy may stop a load between requests (the worker's load cut).
  A load on the loader thread holds its last requests (``engine.load_layered_mb``)
  until the gateway has answered them, tells the engine, then copies them in layer
  by layer (`PageCopy.flush_held`): the forward pass computes each layer as soon as
  its copies are in (`wait_layer`).
- **saves**: plan the step's chunks, open a save before the forward pass
  writes its first layer, gather layer by layer as the forward reports them
  (``save_kv_layer``), close at the end of the step; the saver thread then
  stages each chunk into the view the gateway lent, flushes and waits (the
  `SaveParts`), and commits. A save that cannot be made without waiting for
  the storage is dropped instead, counted in ``save_dropped`` and said once
  per cause (`Dropped`).

Both links' mappings of the gateway's shared memory are seen as byte tensors
(`pinning.PinnedMapping`), page-locked when the cache is on a GPU: if that
fails the external cache is turned off on this rank with one clear log line,
and the engine keeps serving.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvharbor.connector.vllm.chunks import blocks_before, chunk_load, plan_saves, unread_chunks
from kvharbor.connector.vllm.copier import MIB, PageCopy, StagingUnavailable, StepSave, Wait
from kvharbor.connector.vllm.pinning import PinError, PinnedMapping, Register
from kvharbor.connector.vllm.rows import gpu_row_copies
from kvharbor.gateway.shm import ShmUnavailable
from kvharbor.telemetry.log import OnceLog, get_logger

if TYPE_CHECKING:  # Importable without vLLM (bench/gpu.py's data-path part needs none).
    from kvharbor.config import EngineSection
    from kvharbor.connector.link import CacheLink
    from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata

_log = get_logger("kvharbor.connector.vllm")

Count = Callable[..., None]
"""``count(**deltas)``: adds to the worker's stats."""

SavesOf = Callable[["KVHarborMetadata"], "Sequence[ChunkTransfer]"]
"""The transfers of a step's metadata that a data path saves."""


class Dropped(enum.Enum):
    """Why chunks of a step were not saved; the value names what bounds it. Every one is
    counted in the engine stat ``save_dropped`` and each cause said once (`count_dropped`):
    a tier that cannot keep up costs future misses, never the engine's steps."""

    QUEUE = "engine.save_queue_steps_max steps' saves are queued behind the storage already"
    STAGING = (
        "the staging of saves waiting for the storage is full (engine.save_staging_mb_max; a GPU step "
        "waits engine.save_staging_wait_ms for room)"
    )
    RING = (
        "the gateway had no room for them in shared memory by gateway.ring_wait_ms (gateway.ring_mb, "
        "gateway.in_place_mb_max)"
    )


def count_dropped(count: Count, once: OnceLog, why: Dropped, chunks: int) -> None:
    """Count ``chunks`` not saved, and say ``why`` the first time it happens."""
    if chunks <= 0:
        return
    count(save_dropped=chunks)
    once.say(
        f"dropped:{why.name}",
        f"{chunks} chunk(s) of a step not saved: {why.value}. The engine does not wait for the "
        "storage; they will be misses (counted in vllm:kvharbor_save_dropped_total; said once)",
    )


def chunk_saves(meta: KVHarborMetadata) -> Sequence[ChunkTransfer]:
    """A step's chunk saves (`KVHarborMetadata.saves`)."""
    return meta.saves


def state_saves(meta: KVHarborMetadata) -> Sequence[ChunkTransfer]:
    """A step's state saves: those its chunk saves carry (`ChunkTransfer.state`)."""
    return [save.state for save in meta.saves if save.state is not None]


class _Copies:
    """A load's copies as `CacheLink.load_streamed` starts them (`StreamCopies`), telling
    ``ahead()`` each time they are as far ahead of their copy engine as the load gets them
    for now (`DataPath.load`)."""

    def __init__(self, copy: PageCopy, mapping: PinnedMapping, ahead: Callable[[], None] | None) -> None:
        self._copy, self._mapping, self._ahead = copy, mapping, ahead

    def flush(self) -> Callable[[], None]:
        wait = self._copy.flush_load(self._mapping)
        if self._ahead is not None and wait.query():  # Made in the flush (a CPU's), or they keep up.
            self._ahead()
        return lambda: self._waited(wait)

    def _waited(self, wait: Wait) -> None:
        """The load waits for a request's copies: tell ``ahead`` first if they are still running
        (as many requests are under way as may be, or the load has started them all)."""
        if self._ahead is not None and not wait.query():
            self._ahead()
        wait.synchronize()

    def hold(self) -> None:
        self._copy.hold_load()
        if self._ahead is not None:
            self._ahead()  # No copy starts before the held ones: the loader gets no further ahead.

    def flush_held(self) -> Callable[[], None]:
        return self._copy.flush_held(self._mapping).synchronize

    def drop_held(self) -> None:
        self._copy.drop_held()


@dataclass(frozen=True, slots=True)
class SaveParts:
    """What the saver needs to store one step's chunks."""

    keys: list[bytes]
    fill: Callable[[int, memoryview], None]
    """Stage value i's copy into the view the gateway lent."""
    settle: Callable[[], None]
    """Make the staged copies and wait for them: after it every filled value's bytes are
    in shared memory (before the commit)."""
    done: Callable[[], None]
    """Give the save's resources back (always called once, also when the store failed)."""
    reads_blocks: bool
    """The pages are read from the step's blocks when filled (no staging of our own): they
    must be filled before the step returns, unless `snapshot` takes them out first."""
    snapshot: Callable[[], int]
    """`StepSave.snapshot` of the values, in ``keys``' order: how many leading ones it kept."""
    requests: frozenset[str]
    """The requests whose chunks (or states) these are: a step that answers one waits for
    them (``engine.saves_land_before_answer``)."""
    fingerprint: bytes
    """The layout the values are stored under (chunk objects', or a hybrid model's states')."""
    value_bytes: int
    """The bytes of each value."""


class DataPath:
    """A vLLM worker's data path over one `PageCopy`; ``layer_names`` in registration order."""

    def __init__(
        self,
        copy: PageCopy,
        layer_names: Sequence[str],
        load_link: CacheLink,
        save_link: CacheLink,
        rank: int,
        fingerprint: bytes,
        count: Count,
        engine: EngineSection,
        register: Register | None,
        saves_of: SavesOf = chunk_saves,
    ) -> None:
        """``register``: page-locks a mapping for the GPU (`pinning.cuda_host_register`); None
        on the CPU, where copies read and write the mappings as they are. ``saves_of``: which
        transfers of a step it saves (a hybrid model's states have a data path of their own)."""
        self.copy = copy
        self._saves_of = saves_of
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.rank = rank
        self.fingerprint = fingerprint
        self._load_link = load_link
        self._save_link = save_link
        self._count = count
        self._save_staging_wait_s = engine.save_staging_wait_ms / 1000
        self._stall_s = engine.prefill_sample_stall_ms_max / 1000
        self._layered_bytes = engine.load_layered_bytes
        self._register = register
        self.mappings: list[PinnedMapping] = []
        """The load link's mapping, then the save link's; empty when not mapped (cache off)."""
        self._owns_mappings = True
        """False where they are another data path's (`share`): that one unmaps them."""
        self._meta: KVHarborMetadata | None = None
        self._save: StepSave | None = None
        self._save_keys: list[bytes] = []
        self._save_requests: list[str] = []
        """The request of each of ``_save_keys``."""
        self._save_opened = False
        self.stalled = False
        """This step's forward pass waited for save staging (so it is no prefill sample)."""
        self._once = OnceLog(_log)

    def map(self) -> bool:
        """Map both links' shared memory (page-locked on a GPU) and reserve the load staging;
        on failure the cache goes off on this rank."""
        started = time.perf_counter()
        try:
            for link in (self._load_link, self._save_link):
                segment = link.shared_memory()
                if segment is None:
                    self._unmap()
                    return False  # The cache is off already; the link said why.
                if self._register is not None:
                    segment.make_writable()  # Written by DMA only: see `Segment.make_writable`.
                self.mappings.append(PinnedMapping(segment.view, self._register))
        except (PinError, ShmUnavailable) as err:
            self._unmap()
            reason = f"the gateway's shared memory cannot be page-locked for the GPU: {err}"
            _log.error(
                "kvharbor: %s. The external KV cache is off on this rank (no pageable copies on the hot "
                "path); the engine keeps serving. Check the locked-memory limit (ulimit -l, container "
                "memlock) and that gateway.shm_dir is a tmpfs",
                reason,
            )
            self._load_link.switch.turn_off(reason)
            return False
        try:
            self.copy.reserve_loads()
        except StagingUnavailable as err:
            self._unmap()
            _log.error(
                "kvharbor: %s. The external KV cache is off on this rank; the engine keeps serving. "
                "Lower engine.load_batch_mb or vLLM's --gpu-memory-utilization",
                err,
            )
            self._load_link.switch.turn_off(str(err))
            return False
        if self._register is not None:
            _log.info(
                "kvharbor: shared memory page-locked for the GPU (%d mapping(s) of %d MiB in %.2f s); "
                "%.1f MiB per chunk, %d chunk(s) per load request; a restore's last %d MiB layer by layer, %s",
                len(self.mappings), self.mappings[0].size >> 20, time.perf_counter() - started,
                self.copy.chunk_bytes / MIB, self.copy.chunks_per_load, self._layered_bytes // MIB, gpu_row_copies(),
            )  # fmt: skip
        return True

    def share(self, owner: DataPath) -> bool:
        """Use ``owner``'s mappings (mapped, and page-locked once: a second registration of the
        same memory would fail) and reserve this path's load staging; False when ``owner`` has
        none or the staging cannot be had (the cache is then off on this rank)."""
        if not owner.mappings:
            return False
        self.mappings, self._owns_mappings = owner.mappings, False
        try:
            self.copy.reserve_loads()
        except StagingUnavailable as err:
            self.mappings = []
            self._load_link.switch.turn_off(str(err))
            _log.error("kvharbor: %s. The external KV cache is off on this rank; the engine keeps serving", err)
            return False
        return True

    def _unmap(self) -> None:
        if self._owns_mappings:
            for mapping in self.mappings:
                mapping.close()
        self.mappings = []

    # -- loads -----------------------------------------------------------------

    def begin_loads(self) -> None:
        """On the engine's thread, before the step's `load` calls (`PageCopy.begin_loads`)."""
        self.copy.begin_loads()

    def load(
        self,
        transfer: ChunkTransfer,
        proceed: Callable[[int], bool] | None = None,
        ahead: Callable[[], None] | None = None,
        answered: Callable[[int], None] | None = None,
    ) -> int:
        """Restore the leading stored chunks of ``transfer``; returns the block positions
        restored (in every cache group).

        ``proceed(chunks_so_far)``, asked before each further gateway request, may stop the load.
        ``ahead()`` is called each time the copies started are as far ahead of the copy engine
        as this load gets them for now: the loader is about to wait for a request's copies that
        are still running (``loads_queued_max`` requests are under way, or it started them all),
        a request's copies were done by the time its flush returned (made in the flush, as on a
        CPU), or it holds requests for a layered copy (none is copied before the last answer).
        ``answered(blocks)``: called once the gateway has answered the load's last request, with
        the block positions it will have restored unless a copy fails; the load's last requests
        (``engine.load_layered_mb``) are then copied layer by layer (`PageCopy.flush_held`), so
        the engine may start its forward pass (`wait_layer` waits for each layer). Without it
        every request is copied chunk by chunk.
        Called after `begin_loads`, on any one thread at a time.
        """
        if not self.mappings:
            return 0
        mapping, copy = self.mappings[0], self.copy
        per, size = copy.blocks_per_chunk, copy.chunk_bytes
        keys = transfer.keys[self.rank]
        # Chunks wholly out of a sliding window restore nothing: not read at all.
        unread = min(unread_chunks(per, transfer.skip_blocks, transfer.block_ids), len(keys))
        unread_blocks = min(blocks_before(unread, per, transfer.skip_blocks), transfer.blocks)
        accepted: list[int] = []

        def sink(i: int, view: memoryview) -> None:
            if view.nbytes != size or len(accepted) != i:
                return  # Another layout's bytes, or a gap: restore nothing more.
            plan = chunk_load(unread + i, per, transfer.skip_blocks, transfer.block_ids)
            if plan.restores:
                copy.stage_load(mapping, view, plan.parts)
                accepted.append(plan.blocks)

        def go_on(done: int) -> bool:
            return len(accepted) >= done and (proceed is None or proceed(done))

        def blocks(chunks: int) -> int:
            return unread_blocks + sum(accepted[:chunks])

        def told(staged: int) -> None:
            if answered is not None:
                answered(blocks(staged))

        chunks = self._load_link.load_streamed(
            self.fingerprint,
            keys[unread:],
            copy.chunks_per_load,
            sink,
            _Copies(copy, mapping, ahead),
            go_on,
            copy.loads_queued_max,
            hold_from=self._hold_from(len(keys) - unread) if answered is not None else None,
            answered=told,
        )
        restored = min(chunks, len(accepted))
        self._count(loaded_chunks=restored, loaded_bytes=restored * size)
        return blocks(restored)

    def _hold_from(self, chunks: int) -> int | None:
        """The first chunk of a load of ``chunks`` held for a layered copy: its last whole
        requests of about ``engine.load_layered_mb`` (None: none)."""
        per = self.copy.chunks_per_load
        window = min(self._layered_bytes // self.copy.chunk_bytes, self.copy.held_chunks_max)
        requests = -(-chunks // per)
        held = min(window // per, requests)
        return (requests - held) * per if held else None

    def wait_layer(self, layer_name: str) -> None:
        index = self.layer_index.get(layer_name)
        if index is not None:
            self.copy.wait_layer(index)

    # -- saves -----------------------------------------------------------------

    def begin_step(self, meta: KVHarborMetadata) -> None:
        """The step's metadata is bound. Its loads may be running on the loader thread: the
        engine waits for them layer by layer (`wait_layer`) and wholly at `end_step`."""
        self._meta = meta
        self._save, self._save_keys, self._save_requests, self._save_opened = None, [], [], False
        self.stalled = False

    def save_layer(self, layer_name: str) -> None:
        """The forward pass has written this layer: gather its pages of the step's chunks."""
        meta = self._meta
        if meta is None or not self._saves_of(meta):
            return
        if not self._save_opened:
            self._open_save(meta)
        index = self.layer_index.get(layer_name)
        if self._save is not None and index is not None:
            self._save.gather_layer(index)

    def end_step(self, meta: KVHarborMetadata, dropped: AbstractSet[str] = frozenset()) -> SaveParts | None:
        """End of the step's forward pass: finish the gathers; what the saver thread stores.
        ``dropped``: requests whose chunks of this step are not stored (computed over blocks
        whose restore fell short after the forward pass had started)."""
        self.copy.wait_loads()
        saves = self._saves_of(meta)
        if saves and not self._save_opened:
            self._open_save(meta)
        save, requests = self._save, self._save_requests
        kept = [i for i, request in enumerate(requests) if request not in dropped]
        keys = [self._save_keys[i] for i in kept]
        self._meta, self._save, self._save_keys, self._save_requests = None, None, [], []
        self._save_opened = False
        if save is None:
            return None
        save.close()
        mapping = self.mappings[1]
        return SaveParts(
            keys,
            fill=lambda i, view: save.stage(kept[i], mapping, view),
            settle=lambda: save.flush(mapping).synchronize(),
            done=save.release,
            reads_blocks=not self.copy.snapshots_saves,
            snapshot=lambda: save.snapshot(kept),
            requests=frozenset(requests[i] for i in kept),
            fingerprint=self.fingerprint,
            value_bytes=self.copy.chunk_bytes,
        )

    def _open_save(self, meta: KVHarborMetadata) -> None:
        self._save_opened = True
        if len(self.mappings) < 2 or self._save_link.is_off:
            return
        plan = plan_saves(self._saves_of(meta), self.rank, self.copy.blocks_per_chunk)
        save = self.copy.open_save(plan.blocks, self._save_staging_wait_s)
        self.stalled = self.copy.staging_waited_s > self._stall_s
        kept = save.chunks if save is not None else 0
        count_dropped(self._count, self._once, Dropped.STAGING, len(plan.keys) - kept)
        self._save, self._save_keys, self._save_requests = save, plan.keys[:kept], plan.requests[:kept]

    def close(self) -> None:
        self.copy.close()
        self._unmap()
