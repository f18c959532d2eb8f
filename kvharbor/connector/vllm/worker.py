"""The worker half: restore planned chunks into the paged cache, save completed ones.

Loads run before the forward pass (they are planned as synchronous loads),
streamed from the gateway in requests of ``engine.load_batch_mb`` and copied
straight from shared memory into the allocated blocks. They start as early
as the worker can know them (`WorkerSide.prepare_load`: from the scheduler
in the same process, `handoff`, else at ``handle_preemptions``), on a loader
thread, so that their copies overlap the model runner's preparation of the
step's inputs; ``start_load_kv`` waits for the gateway's answers, and the
forward pass for each layer's copies (the last ones cross layer by layer under
it: `DataPath.load`). What the restores delivered is settled after the forward
pass (`WorkerSide._settle`), before vLLM asks for load errors. A chunk that cannot be
loaded (miss, corrupt, cache off, a load cut short because the rest would
arrive slower than it recomputes) reports its blocks as load errors, and vLLM
recomputes them: a failed load costs time, never a wrong token. The
tensor-parallel ranks agree on what each step restored
(`kvharbor.connector.ranks`): they report the same load errors, and none
saves the step's chunks of a request whose restore fell short on any rank
(they were computed over blocks that were not restored).

Saves take each completed chunk's pages before the step's blocks may be reused
and hand the storage write to a background thread (the saver), so that the
engine's steps never wait for the storage. Loads and saves use separate gateway
connections so a slow storage write never delays a load. The copies themselves
are `datapath.DataPath`'s, one algorithm on either device. A save is *landed*
(`CacheLink.land`: the gateway lends places, the values are copied in and
marked complete) and then *committed* (the storage write into the first tier).
One connection answers one request at a time, so a landing on the save link
waits for the commit under way: that is the wait the step must not make.

Saves land even when vLLM kills the engine. What vLLM 0.32 does on SIGINT or
SIGTERM with its default ``--shutdown-timeout 0``: the API server's handler
calls ``AsyncLLM.shutdown(timeout=0)``; the engine-core process manager
(``v1/engine/utils.py`` `CoreEngineProcManager.shutdown`, then
``v1/utils.py`` `shutdown`) sends the engine core SIGTERM and, its deadline
being now, at once ``kill_process_tree``: SIGKILL to the engine core and every
descendant (the worker runs inside the engine core at TP=1, in children of it
otherwise). The engine core's own handler (abort mode) never gets to tear
down, so the connector's ``shutdown()`` is not called and a commit still on
the saver thread dies with the process. Hence completion marks
(`protocol.write_mark`): a landing marks each value in shared memory once its
bytes are there, and a gateway whose client went away stores exactly the
marked values (`Transfers.commit_marked`). The alternative, committing before
the step returns, puts the storage write on the critical path of every
prefill; ``bench/saves.py`` measures it: on a 2-core CPU machine it added
83-128 ms per 2,000-token prompt with the default file tier (1.7 % of that
slow prefill) where the marks cost nothing measurable; on a GPU, whose
prefill is ~100x faster and whose KV is the same size, the commit would
dominate the time to first token.

What a step waits for, from saves, and its bound:

- CPU (`SaveParts.reads_blocks`), the saver idle: the step lands its chunks
  itself, straight from the blocks into shared memory: the gateway's answer
  (room within ``gateway.ring_wait_ms``; a silent gateway turns the cache off
  after ``gateway.request_timeout_ms``) and the copy. When the step returns,
  every chunk it saved is marked.
- CPU, the saver busy (a save queued, landing or committing): the step copies
  its chunks out of the blocks into host staging of the save's own
  (`StepSave.snapshot`, within ``engine.save_staging_mb_max``; no wait), and
  the saver lands them later, as a GPU's.
- GPU: a step only gathers into device staging (waiting for room at most
  ``engine.save_staging_wait_ms``, 0 by default); the saver starts the
  device-to-host copy and marks the values once it has waited for it.
- A step that gives a request its answer's last token by its length limit
  (``max_tokens``: the scheduler names it, `KVHarborMetadata.answered`) waits
  for that request's saves not yet in shared memory (``engine.saves_land_before_answer``,
  on by default), at most ``engine.save_wait_ms``: the saver lands them ahead
  of the commits of the saves queued before them, so the step waits for the
  copy out and the one storage write under way, not for a queue of them. Past
  the bound the step returns; the chunks land behind it (said once), and a
  kill before then loses them. A one-token answer waits in the step that ends
  its prompt; a longer one's saves land while it decodes, and its last step
  rarely waits: under load no step holds up the others' decoding for a save
  (on an H100 at 32 clients, waiting in every step that ended a prompt cost
  each decode step 10-13 ms, 2026-12-08). An answer that ends early, at a stop
  token or string, is not waited for: a kill right after it may lose the saves
  of its last step or two.
- Nothing else: a full save queue (``engine.save_queue_steps_max``), full
  staging and a gateway without room drop the chunks concerned, counted in
  ``save_dropped`` and said once per cause (`datapath.Dropped`).

The engine's counters include the last commit: while a save is queued or
committing, the workers report ``saves_pending`` in their stats and the
scheduler answers vLLM's ``has_pending_push_work`` with yes, so the engine
keeps stepping (without a forward pass) and takes the workers' stats until
the commit has been counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from kvharbor.cache.bandwidth import keep_loading
from kvharbor.cache.keys import namespace_tag
from kvharbor.config import Config
from kvharbor.connector.link import CacheLink, Landing, say_off
from kvharbor.connector.ranks import RankAgreement, SoleRank
from kvharbor.connector.vllm.chunks import NULL_BLOCK
from kvharbor.connector.vllm.copier import PageCopy
from kvharbor.connector.vllm.datapath import DataPath, Dropped, SaveParts, count_dropped, state_saves
from kvharbor.connector.vllm.device_copy import DeviceCopy
from kvharbor.connector.vllm.host_copy import HostCopy
from kvharbor.connector.vllm.layout import CacheGroup, ConnectorRefusal, VllmLayout
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.pages import KVCache, state_view
from kvharbor.connector.vllm.pinning import cuda_host_register
from kvharbor.connector.vllm.stats import empty
from kvharbor.connector.vllm.timing import StepTimer
from kvharbor.telemetry.engine_stats import BY_NAME, Merge
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.connector.vllm")


@dataclass(slots=True)
class _SaveJob:
    parts: SaveParts
    stored_stat: str
    """The stat its stored values count in: ``stored_chunks``, or ``stored_states``."""
    awaited: bool = False
    """A step waits for it to land (it answers one of its requests: ``engine.saves_land_before_answer``);
    set under the worker's stats lock while it is not landed."""
    landed: threading.Event = field(default_factory=threading.Event)
    """Set once its values are in shared memory and marked complete (or landing failed)."""
    landing: Landing | None = None
    """What landing it gave, for the commit; None: nothing to commit."""
    seconds: float = 0.0
    """Spent landing it so far."""


class _Restores:
    """A step's restores, told twice: once the gateway has answered their last request
    (`answer`: the forward pass may start, each layer waiting for its copies), and once
    their copies are done (`done`): per transfer of the step, the leading block positions
    this rank filled. The second may be less than the first (a copy failed, or the room of
    a request could not be given back), never more."""

    def __init__(self, started_s: float) -> None:
        self.started_s = started_s
        self.ended_s = started_s
        self.done: Future[list[int]] = Future()
        self._answered = threading.Event()
        self._blocks: list[int] = []

    def answer(self, blocks: list[int]) -> None:
        """The first answer counts (the loader's end answers again, for a load that never did)."""
        if not self._answered.is_set():
            self._blocks = list(blocks)
            self._answered.set()

    def answered(self) -> list[int]:
        self._answered.wait()
        return self._blocks

    def finish(self, blocks: list[int]) -> None:
        self.ended_s = time.perf_counter()
        self.answer(blocks)
        self.done.set_result(blocks)

    def fail(self, error: BaseException, transfers: int) -> None:
        """A bug in a restore: the engine's thread gets it when it waits for the restores."""
        self.ended_s = time.perf_counter()
        self.answer([0] * transfers)
        self.done.set_exception(error)


@dataclass(frozen=True, slots=True)
class _Loading:
    """A step's restores, started on the loader thread (`WorkerSide.prepare_load`)."""

    meta: KVHarborMetadata
    path: DataPath
    """The chunks' data path."""
    started_s: float
    restores: _Restores | None
    """None where the chunks are restored only in `WorkerSide.load` (a hybrid model's)."""
    states: list[bool]
    """Per transfer, whether its state (if it has one) was restored."""


@dataclass(frozen=True, slots=True)
class _Settling:
    """A step's restores the engine went on with once answered (`WorkerSide.load`); settled
    after its forward pass (`WorkerSide._settle`)."""

    meta: KVHarborMetadata
    agreed: list[int]
    """Per transfer, the block positions every rank had when the gateway answered."""
    restores: _Restores


@dataclass(frozen=True, slots=True)
class Received:
    """Asynchronous loads (`ChunkTransfer.asynchronous`) done since the last report, by request."""

    done: set[str]
    """Every one done, restored or not (vLLM waits for each)."""
    failed: set[str]
    """Of those, the ones that fell short on some rank: vLLM recomputes them."""


class WorkerSide:
    def __init__(
        self,
        layout: VllmLayout,
        config: Config,
        load_link: CacheLink,
        save_link: CacheLink,
        rank: int,
        ranks: RankAgreement | None = None,
    ) -> None:
        """``ranks``: this rank's side of the tensor-parallel agreement (None: a group of one)."""
        self.layout = layout
        self.config = config
        self.rank = rank
        self.fingerprint = layout.digests[rank]
        self.namespace = namespace_tag(layout.fingerprints[rank].key_namespace)
        """Recorded in the headers of what this rank stores (`kvharbor purge --namespace`)."""
        self._load_link = load_link
        self._save_link = save_link
        self._ranks = ranks if ranks is not None else RankAgreement(SoleRank(), load_link.switch)
        self._path: DataPath | None = None
        self._state_path: DataPath | None = None
        """A hybrid model's Mamba-type states (one block per chunk end); None for other models."""
        self._timer: StepTimer | None = None
        self._load_errors: set[int] = set()
        self._received = Received(set(), set())
        self._stats = empty()
        self._stats_lock = threading.Lock()
        self._once = OnceLog(_log)
        self._saves: queue.Queue[_SaveJob | None] = queue.Queue(maxsize=config.engine.save_queue_steps_max)
        """Filled by the engine's thread alone: a put after a check that it is not full finds room."""
        self._saves_pending = 0
        """Save jobs queued, landed or committing; under ``_stats_lock``, counted out with their stats."""
        self._awaited = 0
        """Queued save jobs not landed yet that a step waits for; under ``_stats_lock``."""
        self._unlanded: list[_SaveJob] = []
        """Save jobs queued and not landed when last seen, for a later step that answers one
        of their requests; engine thread only (at most the queue's bound of them)."""
        self._save_wait_s = config.engine.save_wait_ms / 1000
        self._land_before_answer = config.engine.saves_land_before_answer
        self._saver = threading.Thread(target=self._save_loop, name="kvharbor-saver", daemon=True)
        self._saver.start()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvharbor-loader")
        self._loading: _Loading | None = None
        """Set from `prepare_load` until the step's `load` takes it; engine thread only."""
        self._settling: _Settling | None = None
        """Set from the step's `load` until `_settle`; engine thread only."""

    def register(self, registered: Mapping[str, KVCache], num_blocks: int) -> None:
        layout = self.layout
        group_of = dict(zip(registered, layout.groups_of(list(registered)), strict=True))
        kv_names = [n for n in registered if group_of[n] in {g.index for g in layout.kv_groups}]
        state_names = [n for n in registered if n not in kv_names]
        kv_caches: dict[str, torch.Tensor] = {}
        for name, cache in registered.items():
            if name in state_names:
                kv_caches[name] = state_view(cache, num_blocks)
            elif isinstance(cache, torch.Tensor):
                kv_caches[name] = cache
            else:
                raise ConnectorRefusal(f"attention layer {name}: its KV cache was registered as {len(cache)} tensors")
        on_gpu = kv_caches[kv_names[0]].device.type == "cuda"
        copy, names = self._page_copy(kv_caches, kv_names, group_of, layout.kv_groups, layout.blocks_per_chunk,
                                      num_blocks, on_gpu)  # fmt: skip
        self._check_bytes(copy.chunk_bytes, layout.chunk_bytes, "chunk")
        _log.info(
            "kvharbor: %d %scache tensors registered (rank %d, page %d B, %.2f MiB per %d-token chunk; layout %s)",
            len(kv_names), "GPU " if on_gpu else "", self.rank, copy.pages.page_bytes, copy.chunk_bytes / 2**20,
            self.layout.chunk_size, self.layout.fingerprints[self.rank].short(),
        )  # fmt: skip
        engine = self.config.engine
        self._timer = StepTimer(copy.pages.device)
        self._path = DataPath(
            copy, names, self._load_link, self._save_link, self.rank, self.fingerprint, self._count,
            engine, register=cuda_host_register if on_gpu else None,
        )  # fmt: skip
        if state_names:
            # One state per chunk end: a "chunk" of one block of every Mamba-type group.
            state_copy, state_order = self._page_copy(
                kv_caches, state_names, group_of, layout.state_groups, 1, num_blocks, on_gpu
            )
            self._check_bytes(state_copy.chunk_bytes, layout.state_bytes, "state")
            _log.info(
                "kvharbor: %d Mamba-type state tensors registered (rank %d, %.2f MiB per state at a chunk end)",
                len(state_names), self.rank, state_copy.chunk_bytes / 2**20,
            )  # fmt: skip
            self._state_path = DataPath(
                state_copy, state_order, self._load_link, self._save_link, self.rank,
                layout.state_digests[self.rank], self._count_states, engine, register=None, saves_of=state_saves,
            )  # fmt: skip
        # Connect now: an embedded gateway starts here, not in the first request's path.
        if self._load_link.start() and self._save_link.start() and self._path.map() and self._state_path is not None:
            self._state_path.share(self._path)

    def _page_copy(
        self,
        kv_caches: dict[str, torch.Tensor],
        names: Sequence[str],
        group_of: dict[str, int],
        groups: Sequence[CacheGroup],
        blocks_per_chunk: int,
        num_blocks: int,
        on_gpu: bool,
    ) -> tuple[PageCopy, list[str]]:
        """The page copy of the layers ``names`` of ``groups`` (their blocks are
        `ChunkTransfer.block_ids` in that order), and the layers in its order: each group's
        together (`pages`), so a load copies only the groups it restores."""
        position = {g.index: i for i, g in enumerate(groups)}
        ordered = sorted(names, key=lambda n: position[group_of[n]])
        tensors, indices = [kv_caches[n] for n in ordered], [position[group_of[n]] for n in ordered]
        engine = self.config.engine
        if on_gpu:
            copy: PageCopy = DeviceCopy.for_engine(tensors, num_blocks, blocks_per_chunk, engine, indices)
        else:
            copy = HostCopy(
                tensors, num_blocks, blocks_per_chunk, engine.load_batch_bytes, engine.save_staging_bytes_max, indices
            )
        return copy, ordered

    def _count_states(self, **deltas: float) -> None:
        """The state path's counts: its values are states, not chunks."""
        for chunks, states in (("loaded_chunks", "loaded_states"), ("stored_chunks", "stored_states")):
            if chunks in deltas:
                deltas[states] = deltas.pop(chunks)
        self._count(**deltas)

    def stay_off(self, reason: str) -> None:
        """`register` refused this engine's KV cache, and the engine runs on without the
        cache (``KVHARBOR=1`` alone): off on this rank for good, never connected. A restore
        planned before the scheduler learns it (from this rank's stats) fills nothing, so
        its blocks are reported for recompute; nothing is stored."""
        if self._path is not None:
            raise RuntimeError("stay_off after a registration that succeeded")
        self._ranks.switch.turn_off(reason)

    def _check_bytes(self, registered: int, expected: int, what: str) -> None:
        """The scheduler looks up values of `VllmLayout.chunk_bytes` (and `state_bytes`): a
        worker whose values had another size would find every one of them a miss."""
        if expected and registered != expected:
            raise ConnectorRefusal(
                f"the registered KV cache holds {registered} bytes per {what} where the KV cache config says "
                f"{expected} ({', '.join(g.descriptor for g in self.layout.groups)}): its values would never "
                "match the scheduler's (tell us the model and this line)"
            )

    # -- steps --------------------------------------------------------------------------

    def _paths(self) -> list[DataPath]:
        """The data paths: the chunks', then a hybrid model's states'."""
        return [p for p in (self._path, self._state_path) if p is not None]

    def begin_step(self, meta: KVHarborMetadata) -> None:
        """The step's metadata is bound; its forward pass follows."""
        for path in self._paths():
            path.begin_step(meta)
        if self._timer is not None:
            if meta.step_flops > 0 and not meta.loads:
                self._timer.begin()
            else:
                self._timer.cancel()

    def wait_layer(self, layer_name: str) -> None:
        if self._path is not None:
            self._path.wait_layer(layer_name)

    def save_layer(self, layer_name: str) -> None:
        for path in self._paths():
            path.save_layer(layer_name)

    # -- loads -------------------------------------------------------------------

    def prepare_load(self, meta: KVHarborMetadata) -> None:
        """Start the step's restores on the loader thread, on the engine's thread before the
        model runner prepares the step's inputs (`handoff`, ``handle_preemptions``); a step
        already started is not started again.

        Their copies then overlap that preparation (12-29 ms of a 130,000-token restore on an
        H100 or H200: `docs/performance.md`), during which the loader thread queues next to
        nothing: vLLM's thread holds the interpreter. This thread therefore first waits, at most
        ``engine.load_start_wait_ms``, until the copies are as far ahead of the copy engine as
        they get (``engine.loads_in_flight_max`` requests still being copied, or all started:
        `DataPath.load`'s ``ahead``), so that the copy engine has that much to do meanwhile.
        Nothing the preparation does touches the KV cache, and the engine reads no restored
        block before `load` has waited for the restores.
        """
        if not meta.loads or self._path is None or self._loading is not None:
            return
        self._settle()  # The last step's, should vLLM not have asked for its saves (not seen).
        started = time.perf_counter()
        for path in self._paths():
            path.begin_loads()
        states = self._restore_states(meta.loads)
        if self._state_path is not None:
            # vLLM zeroes a hybrid model's new attention blocks after this call (its runner's
            # ``_update_states``: ``new_block_ids_to_zero``): its chunks are restored in `load`.
            self._loading = _Loading(meta, self._path, started, None, states)
            return
        restores, ahead = self._start_restores(self._path, meta.loads, states, started)
        self._loading = _Loading(meta, self._path, started, restores, states)
        # The loader needs the interpreter to queue copies, which vLLM's thread holds from here on.
        ahead.wait(self.config.engine.load_start_wait_ms / 1000)

    def _start_restores(
        self, path: DataPath, transfers: Sequence[ChunkTransfer], states: Sequence[bool], started_s: float
    ) -> tuple[_Restores, threading.Event]:
        """`_restore_announced` of ``transfers`` started on the loader thread, after
        ``path``'s `DataPath.begin_loads` on this (the engine's) thread; and the event set once
        their copies are as far ahead as they get (`DataPath.load`'s ``ahead``) or they ended."""
        ahead = threading.Event()
        restores = _Restores(started_s)
        self._loader.submit(self._restore_announced, transfers, states, ahead, restores)
        return restores, ahead

    def load(self, meta: KVHarborMetadata) -> None:
        """Restore the step's planned chunks, as far as every rank could (`RankAgreement`).

        Returns once the gateway has answered the step's restores: their last copies may
        still run (a restore's last ``engine.load_layered_mb`` cross layer by layer), and
        the forward pass waits for each layer's (`wait_layer`). What they restored is
        settled after the forward pass (`_settle`), before the step's saves are taken and
        its load errors reported: vLLM asks for those only then.

        Every rank reaches the agreement in the same steps (those with loads or
        ``cache_off``), whatever its own state: the condition is the metadata's.
        The step's saves of a request whose restore fell short are dropped from
        ``meta.saves`` (this worker's copy: pickled to it, or, in the scheduler's
        process, built for this step and not read again): their chunks are computed
        over blocks that were not restored. vLLM recomputes them, and the scheduler
        saves them then (`SchedulerSide.observe_load_errors`).
        """
        loading, self._loading = self._loading, None
        if loading is not None and loading.meta is not meta:
            # Started for a step that never came to its forward pass (not seen with vLLM
            # 0.26-0.32): its blocks were that step's; wait, so no copy outlives the step.
            if loading.restores is not None:
                futures.wait([loading.restores.done])
            loading = None
        self._settle()  # The last step's, should vLLM not have asked for its saves (not seen).
        if not meta.loads and not meta.cache_off:
            return
        if loading is not None and loading.restores is not None:
            restores = loading.restores
        elif loading is not None:  # A hybrid model's chunks, after vLLM zeroed their blocks.
            # Ordered after the zeroing, which vLLM queued on the engine's stream since
            # `prepare_load`; their last copies then run under the forward pass, as above.
            loading.path.begin_loads()
            restores, _ = self._start_restores(loading.path, meta.loads, loading.states, loading.started_s)
        else:  # No ``handle_preemptions`` before (a vLLM without it): restore now.
            restores = _Restores(time.perf_counter())
            for path in self._paths() if meta.loads else ():
                path.begin_loads()
            # Too late for the states of a hybrid model's synchronous loads: vLLM has copied them
            # on already (`_restore_states`). An asynchronous load's request does not run this step.
            early = iter(self._restore_states([t for t in meta.loads if t.asynchronous]))
            states = [next(early) if t.asynchronous else t.state is None for t in meta.loads]
            restores.finish(self._restore_all(meta.loads, states))
        agreed = self._ranks.agree(restores.answered())
        if meta.cache_off and self._ranks.switch.turn_off(meta.cache_off):
            say_off(meta.cache_off)
        short = set()
        for transfer, blocks in zip(meta.loads, agreed, strict=True):
            self._count(load_errors=transfer.blocks - blocks)
            if transfer.asynchronous:  # Reported by request (`take_received`).
                self._received.done.add(transfer.request_id)
                if blocks < transfer.blocks:
                    self._received.failed.add(transfer.request_id)
                continue
            # Every group's blocks past those restored (a null block is nobody's, not an error).
            self._load_errors.update(b for ids in transfer.block_ids for b in ids[blocks:] if b != NULL_BLOCK)
            if blocks < transfer.blocks:
                short.add(transfer.request_id)
        if short:
            meta.saves = [save for save in meta.saves if save.request_id not in short]
        self._settling = _Settling(meta, agreed, restores)

    def _settle(self) -> AbstractSet[str]:
        """After the forward pass: wait for the step's restores to be done and agree with the
        other ranks on what they restored. Blocks the answer promised and the copies did not
        deliver are load errors (vLLM recomputes them; their step's answer is discarded), and
        the requests they belong to are returned: this step's chunks of theirs are computed
        over them, and are not stored. A collective where `load` made one (every rank settles
        in the same steps: at the first of `save`, `take_received`, `take_load_errors`, `take_stats`)."""
        settling, self._settling = self._settling, None
        if settling is None or not settling.meta.loads:
            return frozenset()
        meta, restores = settling.meta, settling.restores
        done = self._ranks.agree(restores.done.result())
        short = set()
        for transfer, answered, blocks in zip(meta.loads, settling.agreed, done, strict=True):
            if blocks >= answered:
                continue
            short.add(transfer.request_id)
            self._count(load_errors=answered - blocks)
            if transfer.asynchronous:
                self._received.failed.add(transfer.request_id)
            else:
                lost = (b for ids in transfer.block_ids for b in ids[blocks:answered])
                self._load_errors.update(b for b in lost if b != NULL_BLOCK)
        if short:
            self._once.say("late", "a restore the forward pass had started on fell short; recomputed (said once)")
        seconds = restores.ended_s - restores.started_s
        self._count(loads=1, load_seconds=seconds, cache_off=int(self._load_link.is_off))
        return short

    def _restore_states(self, transfers: Sequence[ChunkTransfer]) -> list[bool]:
        """A hybrid model's states, restored now, on the engine's thread, and waited for: per
        transfer, whether it has its state (or needs none).

        In ``align`` mode vLLM copies a request's state from the block of its last computed
        block boundary into the block it runs on (``preprocess_mamba``) after
        ``handle_preemptions`` (`prepare_load`), before ``start_load_kv``: a state restored
        later would never be read.
        """
        path = self._state_path

        def restore(state: ChunkTransfer | None) -> bool:
            if state is None:
                return True
            if path is None or NULL_BLOCK in (ids[0] for ids in state.block_ids):
                return False
            return path.load(state) == 1

        restored = [restore(t.state) for t in transfers]
        if path is not None:
            path.copy.wait_loads()  # On a GPU the engine's stream waits for them.
        return restored

    def _restore_announced(
        self, transfers: Sequence[ChunkTransfer], states: Sequence[bool], ahead: threading.Event, restores: _Restores
    ) -> None:
        """`_restore_all` on the loader thread, setting ``ahead`` once its copies are as far
        ahead as they get or it ended, and telling ``restores`` of the gateway's answer and of
        the end, whatever the end."""
        try:
            restores.finish(self._restore_all(transfers, states, ahead.set, restores.answer))
        except BaseException as err:
            restores.fail(err, len(transfers))
        finally:
            ahead.set()
            for path in self._paths():
                path.copy.drop_held()  # A held flush that never ran releases the engine's layers.

    def _restore_all(
        self,
        transfers: Sequence[ChunkTransfer],
        states: Sequence[bool],
        ahead: Callable[[], None] | None = None,
        answered: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """This rank's restores: per transfer, how many of its leading block positions it
        filled. ``states``: per transfer, whether its state (if it has one) was restored.
        ``ahead``: `DataPath.load`'s. ``answered(blocks)``: per transfer, what the gateway's
        answers promise, once the last transfer's last request is answered; the last
        transfer's last requests are then copied layer by layer (`DataPath.load`)."""
        path = self._path
        if path is None:
            return [0] * len(transfers)
        restored: list[int] = []
        for i, (transfer, state) in enumerate(zip(transfers, states, strict=True)):
            told = None
            if answered is not None and i == len(transfers) - 1:

                def told(blocks: int, transfer: ChunkTransfer = transfer) -> None:
                    answered([*restored, self._kept(transfer, blocks)])

            restored.append(self._restore(path, transfer, state, ahead, told))
        return restored

    def _restore(
        self,
        path: DataPath,
        transfer: ChunkTransfer,
        has_state: bool,
        ahead: Callable[[], None] | None,
        answered: Callable[[int], None] | None,
    ) -> int:
        """One transfer's restore."""
        if not has_state:
            return 0
        # With several cache groups vLLM 0.26-0.32 cannot recompute blocks a load did not fill
        # (its scheduler raises for invalid blocks of several groups): such a load is not cut.
        cut = self._load_cut(transfer, path.copy.chunk_bytes) if len(self.layout.groups) == 1 else None
        return self._kept(transfer, path.load(transfer, cut, ahead, answered))

    @staticmethod
    def _kept(transfer: ChunkTransfer, restored: int) -> int:
        """A hybrid model's chunks are restored all or none, and only with their state: it is
        the state after the last chunk, and vLLM computing on from an earlier block would find
        no state there."""
        return restored if transfer.state is None or restored == transfer.blocks else 0

    def _load_cut(self, transfer: ChunkTransfer, chunk_bytes: int) -> Callable[[int], bool]:
        """The load-cut policy of one transfer: asked with the chunks restored so far, whether
        the rest still arrives faster than the engine recomputes it (`keep_loading`)."""
        started = time.perf_counter()
        chunks = transfer.chunks

        def proceed(done: int) -> bool:
            elapsed_s = time.perf_counter() - started
            left = transfer.recompute_s[done:] if transfer.recompute_s else None
            if keep_loading(elapsed_s, done * chunk_bytes, (chunks - done) * chunk_bytes, sum(left) if left else None):
                return True
            self._count(loads_cut=1)
            self._once.say(
                "cut",
                f"a restore was stopped after {done} of {chunks} chunks: at the "
                f"{done * chunk_bytes / elapsed_s / 1e9:.2f} GB/s it got, the rest "
                "arrives slower than it recomputes (recomputed instead; said once)",
                logging.INFO,
            )
            return False

        return proceed

    def take_load_errors(self) -> set[int]:
        self._settle()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_received(self) -> Received:
        """The asynchronous loads done since the last call (vLLM asks once a step, after the
        step's loads: `load` has agreed on them with every rank by then)."""
        self._settle()
        received, self._received = self._received, Received(set(), set())
        return received

    # -- saves -------------------------------------------------------------------

    def save(self, meta: KVHarborMetadata) -> None:
        """Take this step's completed chunks before its blocks may be reused; the copy
        out of staging (GPU) and the commit run behind the engine, on the saver thread."""
        dropped = self._settle()
        path = self._path
        if self._timer is not None:
            if path is not None and path.stalled:
                self._timer.cancel()  # The forward waited for save staging: not a prefill sample.
            else:
                self._timer.end(meta.step_flops)
        if path is None:
            return
        self._queue_save(path.end_step(meta, dropped), "stored_chunks")
        if self._state_path is not None:
            self._queue_save(self._state_path.end_step(meta, dropped), "stored_states")
        self._await_answered(meta.answered)

    def _queue_save(self, parts: SaveParts | None, stored_stat: str) -> None:
        """Hand one data path's save of this step to the saver. The step never waits for a
        storage write: a save that reads the blocks (a CPU's) is landed here only when the
        saver is idle (nothing queued or committing: the link is free), else snapshotted out
        of the blocks first, as a GPU's is gathered. What finds no room is dropped."""
        if parts is None:
            return
        if self._saves.full():
            parts.done()
            count_dropped(self._count, self._once, Dropped.QUEUE, len(parts.keys))
            return
        job = _SaveJob(parts, stored_stat)
        with self._stats_lock:
            idle = self._saves_pending == 0
        if parts.reads_blocks and idle:
            # Marked complete in shared memory before the step returns, on this thread: the
            # saver has nothing of its own on the link, so only the gateway's answer (room by
            # gateway.ring_wait_ms at most) and the copy itself are waited for.
            self._land(job)
        elif parts.reads_blocks:
            kept = parts.snapshot()
            count_dropped(self._count, self._once, Dropped.STAGING, len(parts.keys) - kept)
            if not kept:
                parts.done()
                return
            job.parts = replace(parts, keys=parts.keys[:kept])
        with self._stats_lock:
            self._saves_pending += 1
        self._saves.put_nowait(job)
        if not job.landed.is_set():
            self._unlanded.append(job)

    def _await_answered(self, answered: Sequence[str]) -> None:
        """This step answers ``answered`` (their last token by their length limit): wait until
        their saves are in shared memory, all of them within ``engine.save_wait_ms``."""
        self._unlanded = [job for job in self._unlanded if not job.landed.is_set()]
        if not answered or not self._land_before_answer:
            return
        asked = set(answered)
        waited = [job for job in self._unlanded if not asked.isdisjoint(job.parts.requests)]
        with self._stats_lock:  # Against the saver's count of it once landed (`_save_loop`).
            for job in waited:
                if not job.landed.is_set() and not job.awaited:
                    job.awaited = True
                    self._awaited += 1
        deadline = time.monotonic() + self._save_wait_s
        for job in waited:
            if not job.landed.wait(max(0.0, deadline - time.monotonic())):
                self._once.say(
                    "answer-unlanded",
                    "a step that completes an answer returned before that request's saves were in shared memory: "
                    "the saver was still busy with earlier saves' storage writes after engine.save_wait_ms. They "
                    "land behind the step; an engine killed before then loses them (said once)",
                )
                return

    def _save_loop(self) -> None:
        """Land each queued save, then commit it. A save whose step waits for it (it ends a
        prompt) is landed ahead of the commits of the saves queued before it, which the step
        would otherwise wait for as well: it waits for no more than the commit under way."""
        landed: deque[_SaveJob] = deque()
        while True:
            with self._stats_lock:
                awaited = self._awaited
            if landed and not awaited:
                self._commit(landed.popleft())
                continue
            job = self._saves.get()
            if job is None:
                break
            if not job.landed.is_set():
                self._land(job)
                with self._stats_lock:  # A step marks a job awaited only while it is not landed.
                    self._awaited -= int(job.awaited)
            landed.append(job)
        while landed:
            self._commit(landed.popleft())

    def _land(self, job: _SaveJob) -> None:
        """Put a save's values into shared memory and mark them complete (`CacheLink.land`)."""
        started = time.perf_counter()
        parts = job.parts
        try:
            job.landing = self._save_link.land(
                parts.fingerprint, [(key, parts.value_bytes) for key in parts.keys], parts.fill, parts.settle,
                self.namespace,
            )  # fmt: skip
            count_dropped(self._count, self._once, Dropped.RING, job.landing.no_room)
        except Exception:
            # A bug in a copy must not end the saver (every later save would queue behind it).
            _log.exception("kvharbor: internal error saving %d chunks; they are not saved", len(parts.keys))
        finally:
            parts.done()  # The bytes are in shared memory: staging is free before the storage write.
            job.seconds += time.perf_counter() - started
            job.landed.set()

    def _commit(self, job: _SaveJob) -> None:
        """Store a landed save's values, and count it out with its stats."""
        started = time.perf_counter()
        stored = 0
        try:
            if job.landing is not None:
                stored = self._save_link.commit(job.landing)
        except Exception:
            _log.exception("kvharbor: internal error storing %d chunks; they are not saved", len(job.parts.keys))
        finally:
            with self._stats_lock:  # Counted out with its stats, in one step's report.
                self._saves_pending -= 1
                self._add(
                    saves=int(job.stored_stat == "stored_chunks"),  # A step's save, not its states'.
                    save_seconds=job.seconds + time.perf_counter() - started,
                    stored_bytes=stored * job.parts.value_bytes,
                    cache_off=int(self._save_link.is_off),
                    **{job.stored_stat: stored},
                )

    # -- stats and shutdown ----------------------------------------------------------

    def take_stats(self) -> dict[str, float]:
        """The stats since the last call; ``saves_pending`` is the saves not yet counted,
        taken with them: a report saying none are pending includes the last commit."""
        self._settle()
        with self._stats_lock:
            stats, self._stats = self._stats, empty()
            stats["saves_pending"] = self._saves_pending
        if self._timer is not None:
            stats["prefill_flops"], stats["prefill_seconds"] = self._timer.take()
        # Every step once off, not only in a step that moved data: once the cache is
        # off nothing moves, and the state must still reach the metrics.
        stats["cache_off"] = max(stats["cache_off"], int(self._load_link.is_off))
        return stats

    def close(self) -> None:
        self._loader.shutdown(wait=True)  # A restore in flight ends before its memory is unmapped.
        self._saves.put(None)
        self._saver.join(timeout=self.config.gateway.request_timeout_ms / 1000 * 2)
        for path in reversed(self._paths()):
            path.close()  # Unpin before the links unmap their shared memory (the chunks' path owns them).
        self._load_link.close()
        self._save_link.close()

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            self._add(**deltas)

    def _add(self, **deltas: float) -> None:
        """`_count` with ``_stats_lock`` held; a name not in `ENGINE_STATS` is a bug (KeyError)."""
        for name, delta in deltas.items():
            if BY_NAME[name].merge is Merge.MAX:
                self._stats[name] = max(self._stats[name], delta)
            else:
                self._stats[name] += delta
