"""The scheduler half: how much of a prompt is stored, and which chunks move each step.

Per request it computes the chunk keys once (for every rank), asks the gateway
how many leading chunks *all* ranks hold (one batched lookup with the ranks'
keys interleaved), and promises only chunks known intact: those in a
shared-memory RAM tier at once, the others once read back (`verifier`; vLLM
is told "not known yet" meanwhile and asks again the next step). What vLLM is
told is cached is what is restored. It plans:

- a load of the stored chunks past vLLM's own prefix-cache hit, bounded by
  floor(N / chunk_size) x chunk_size and stopped one token short of the
  prompt, because vLLM must compute the last prompt position itself;
- a save of each prompt chunk the step completes, once; a chunk that failed
  its read-back, or its load, is saved again from the recomputed KV.

A hybrid model's Mamba-type groups hold one recurrent state per request, not KV per
token: vLLM (``--mamba-cache-mode align``) keeps it at block boundaries where a step
ends. Where a step ends on a chunk boundary, that state is stored beside the chunk
(a state object, `VllmLayout.state_keys`), and a restore ends only at a chunk whose
state is stored: its chunks and that state are restored together, or nothing is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from kvharbor.cache.bandwidth import PREFILL_SAMPLE_FLOPS_MIN, LoadPlanner, keep_loading
from kvharbor.cache.keys import ChunkKey
from kvharbor.config import Config
from kvharbor.connector.link import CacheLink
from kvharbor.connector.verifier import Verification, Verifier
from kvharbor.connector.vllm.chunks import NULL_BLOCK, GroupBlocks, leading_nulls, span
from kvharbor.connector.vllm.layout import VllmLayout
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.stats import empty
from kvharbor.telemetry.engine_stats import check_names
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.connector.vllm")


@dataclass(slots=True)
class _Request:
    keys: list[list[ChunkKey]]
    """Per rank, the keys of the prompt's full chunks."""
    prompt_tokens: int
    max_tokens: int | None = None
    """The answer's length limit (vLLM's ``Request.max_tokens``; None: not known)."""
    state_keys: list[list[ChunkKey]] = field(default_factory=list)
    """Per rank, the keys of the state at each full chunk's end (hybrid models; else empty)."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's blocks (`chunks.GroupBlocks`); empty until scheduled."""
    saved_chunks: int = 0
    """Chunks already planned for saving (or known to be stored)."""
    state_chunks: int = 0
    """A hybrid model's chunks whose last one's state is stored or planned for saving."""
    local_tokens: int = 0
    """vLLM's own prefix-cache hit at the last admission question: a load starts there."""
    load: ChunkTransfer | None = None
    load_first_chunk: int = 0
    """The chunk ``load`` starts in."""
    resident_chunks: int = 0
    """Leading stored chunks in a shared-memory RAM tier at the last lookup."""
    verification: Verification | None = None
    """The read-back of its stored chunks outside RAM, once one was needed."""
    verify_floor: int = 0
    """The leading chunks promised without a read-back (resident, or vLLM's own) when it began."""
    read_back_skipped: bool = False
    """Its chunks outside RAM were not read back: that was predicted slower than recomputing."""
    stateless_counted: bool = False
    """Its stored chunks recomputed for want of a state are counted (vLLM may ask again)."""
    load_failed: bool = False
    """Its asynchronous load fell short (`observe_failed_loads`): vLLM recomputes it, and it
    is never offered a load again."""


@dataclass(slots=True)
class SchedulerCounters:
    """Totals since start, each request counted once; `SchedulerSide.take_stats` reports deltas."""

    lookups: int = 0
    lookup_chunks: int = 0
    """Full prompt chunks asked for."""
    hit_chunks: int = 0
    """Of those, the leading chunks promised: stored, and resident in RAM or read back intact."""
    verified_chunks: int = 0
    """Stored chunks outside RAM read back intact before they were promised."""
    unverified_chunks: int = 0
    """Stored chunks not promised: damaged, of the wrong size, or not read back within
    engine.verify_wait_ms; recomputed."""
    read_back_skipped_chunks: int = 0
    """Stored chunks outside RAM not read back: reading them was predicted slower than
    recomputing them; recomputed."""
    unsalted_skipped: int = 0
    """Requests neither looked up nor stored because require_cache_salt is on and they had no salt."""
    bad_salt_skipped: int = 0
    short_prompts: int = 0
    """Prompts shorter than one chunk: nothing to look up."""
    chose_recompute: int = 0
    """Requests whose stored prefix was recomputed: loading it was predicted slower."""
    stateless_chunks: int = 0
    """Stored chunks of a hybrid model past the last chunk end with a stored state."""
    window_unsaved: int = 0
    """Chunks not saved: vLLM had freed their blocks, out of a sliding window, before the save."""

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


check_names((f.name for f in fields(SchedulerCounters)), "SchedulerCounters")


class SchedulerSide:
    def __init__(
        self,
        layout: VllmLayout,
        config: Config,
        link: CacheLink,
        planner: LoadPlanner | None = None,
        verifier: Verifier | None = None,
        asynchronous_loads: bool = False,
    ) -> None:
        self.layout = layout
        self.config = config
        self.link = link
        self.verifier = verifier
        """Reads back stored chunks outside RAM before they are promised; None: such
        chunks are never promised (recomputed)."""
        self.planner = planner
        """Load or recompute (`kvharbor.cache.bandwidth`); None: always load."""
        self.asynchronous_loads = asynchronous_loads
        """Loads are vLLM's asynchronous ones (`ChunkTransfer.asynchronous`): for a model with
        several KV cache groups, whose failed load vLLM recomputes only when it is reported by
        request. Else synchronous: a load is done within the step that computes past it."""
        self.saves_pending = False
        """The workers' last report had saves not yet counted (`worker` says why it matters)."""
        self._off_reason = ""
        """Why the external cache is off somewhere ("": on); no restore is planned then."""
        self._off_sent = False
        """`_off_reason` went to the workers in a step's metadata (once is enough)."""
        self._chose_recompute: set[str] = set()
        self._remeasuring: set[str] = set()
        """Requests whose load re-measures a stale rate: they load however often vLLM asks."""
        self.counters = SchedulerCounters()
        self._requests: dict[str, _Request] = {}
        self._skipped: set[str] = set()
        """Requests judged not cacheable (and counted) already: vLLM may ask again each step."""
        self._loads: list[ChunkTransfer] = []
        self._once = OnceLog(_log)
        self._reported = self.counters.snapshot()

    # -- admission ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External tokens loadable past ``num_computed_tokens``, or None while stored chunks
        are being read back (vLLM asks again the next step); and whether their load is
        asynchronous (`asynchronous_loads`)."""
        state = self._request(request)
        if state is None or not state.keys[0] or state.load_failed:
            return 0, False
        hit_chunks = self._promised_chunks(request.request_id, state, request.num_tokens, num_computed_tokens)
        if hit_chunks is None:
            return None, False
        state.saved_chunks = max(state.saved_chunks, hit_chunks)  # Stored intact already: never re-save.
        # vLLM sets request.num_computed_tokens only after `update_state_after_alloc`,
        # so remember where the local hit ends for the load plan made there.
        state.local_tokens = num_computed_tokens
        end = self._hit_end(hit_chunks, request.num_tokens)
        assert end <= self.layout.max_hit_tokens(request.num_tokens)
        if end > num_computed_tokens and not self._worth_loading(request.request_id, num_computed_tokens, end):
            return 0, False
        tokens = max(0, end - num_computed_tokens)
        return tokens, self.asynchronous_loads and tokens > 0

    def _promised_chunks(self, req_id: str, state: _Request, num_tokens: int, num_computed_tokens: int) -> int | None:
        """The leading chunks to promise: stored, and resident or read back intact; None
        while a read-back is under way. At most one read-back per request."""
        size = self.layout.chunk_size
        job = state.verification
        if job is not None:
            promised = self._settled_chunks(job, state, num_tokens)
            if promised is None or num_computed_tokens >= state.verify_floor * size:
                return promised
            return state.resident_chunks  # vLLM's own hit shrank below what was read back.
        ranks = self.layout.ranks
        interleaved = [state.keys[r][i] for i in range(len(state.keys[0])) for r in range(ranks)]
        found = self.link.lookup(interleaved, size // ranks or 1, self.layout.chunk_bytes)
        self.counters.lookups += 1
        self.counters.lookup_chunks += len(state.keys[0])
        hits, resident = found.hits // ranks, found.resident // ranks
        if state.state_keys:
            state.saved_chunks = max(state.saved_chunks, min(hits, len(state.keys[0])))  # Stored: never re-saved.
            hits = self._state_end(state, hits, num_tokens, num_computed_tokens // size)
            state.state_chunks = max(state.state_chunks, hits)
            resident = hits if resident >= hits else 0  # A shorter part in RAM ends at no state.
        state.resident_chunks = resident
        # Chunks vLLM holds itself are not loaded: reading them back would be wasted.
        first = max(resident, num_computed_tokens // size)
        hit_end = self._hit_end(hits, num_tokens)
        end = -(-hit_end // size)  # The chunks a load of them would touch.
        if (
            end <= first
            or hit_end <= num_computed_tokens
            or not self._worth_loading(req_id, num_computed_tokens, hit_end)
        ):
            self.counters.hit_chunks += hits
            return hits
        wait_s = self.config.engine.verify_wait_ms / 1000
        if self.verifier is None or wait_s <= 0:
            self.counters.hit_chunks += first
            self.counters.unverified_chunks += end - first
            return first
        # Chunks wholly before a sliding window at the hit's end are never read: nor read back.
        read_from = min(max(first, self._out_of_window(hits, num_tokens)), end - 1)
        if not self._worth_loading(req_id, num_computed_tokens, hit_end, self._read_back_bytes(end - read_from)):
            # Reading them back would take longer than recomputing them: only the chunks
            # that need no read-back are offered (loaded if that is still worth it). The rest
            # stay stored, unread: recomputed, not stored again.
            state.saved_chunks = max(state.saved_chunks, hits)
            if not state.read_back_skipped:  # vLLM may ask again: counted once.
                state.read_back_skipped = True
                self.counters.hit_chunks += first
                self.counters.read_back_skipped_chunks += end - first
            return first
        state.verify_floor = first
        state.verification = self.verifier.submit(
            state.keys, read_from, end, hits, wait_s, self._read_back_timed, self._read_back_cut(read_from, hit_end)
        )
        return None

    def _state_end(self, state: _Request, hits: int, num_tokens: int, own: int) -> int:
        """A hybrid model's restorable chunks: the most, at most ``hits`` (stored) and past
        ``own`` (vLLM's own hit), whose last chunk's state is stored, intact, for every rank;
        0 when there is none. One question for every chunk end (`CacheLink.locate`), then the
        one found is looked up at its size and, outside RAM, read back (it is small: the
        states of one position, where the chunks are the KV of every position)."""
        size, ranks = self.layout.chunk_size, self.layout.ranks
        top = min(hits, self._hit_end(hits, num_tokens) // size)
        if top <= own:
            return 0
        candidates = range(top, own, -1)
        asked = [state.state_keys[r][c - 1] for c in candidates for r in range(ranks)]
        held = self.link.locate(asked)
        found = next((c for i, c in enumerate(candidates) if all(held[i * ranks : (i + 1) * ranks])), 0)
        if found:
            keys = [state.state_keys[r][found - 1] for r in range(ranks)]
            looked = self.link.lookup(keys, size, self.layout.state_bytes)
            if looked.hits < ranks:
                found = 0  # Of another size: another layout's bytes under its key (never seen).
            elif looked.resident < ranks:
                items = list(zip(self.layout.state_digests, keys, strict=True))
                if self.link.verify(items, self.layout.state_bytes) != ranks:
                    found = 0
        if found < top:
            if not state.stateless_counted:  # vLLM may ask again: counted once.
                state.stateless_counted = True
                self.counters.stateless_chunks += top - max(found, own)
            self._once.say(
                "stateless",
                f"stored chunks of a hybrid model were recomputed: no Mamba-type state is stored at their end (a "
                f"state is stored where a step ends on a chunk boundary, {size} tokens); said once, counted in "
                "stateless_chunks",
                logging.INFO,
            )
        return found

    def _read_back_cut(self, read_from: int, hit_end: int) -> Callable[[int, float], bool] | None:
        """The read-back's cut policy for chunks ``read_from`` .. the one ending at ``hit_end``:
        asked with the chunks read back so far and the seconds they took, whether the rest
        still arrives faster than vLLM recomputes it (`keep_loading`, as a load is cut)."""
        planner = self.planner
        recompute = planner.chunk_recompute_s(read_from * self.layout.chunk_size, hit_end) if planner else ()
        if not recompute:
            return None

        def proceed(done: int, elapsed_s: float) -> bool:
            left = len(recompute) - done
            return keep_loading(
                elapsed_s, self._read_back_bytes(done), self._read_back_bytes(left), sum(recompute[done:])
            )

        return proceed

    def _read_back_bytes(self, chunks: int) -> int:
        """What reading ``chunks`` back moves: every rank's value of each (one stream)."""
        return chunks * self.layout.ranks * self.layout.chunk_bytes

    def _out_of_window(self, hit_chunks: int, num_tokens: int) -> int:
        """Leading chunks of a restore of ``hit_chunks`` that vLLM keeps no block of: wholly
        before the sliding window at the restore's end (vLLM's ``SlidingWindowManager`` holds
        the last ``window - 1`` tokens' blocks); 0 without a window."""
        window = self.layout.window_tokens
        if window is None:
            return 0
        block = self.layout.block_size
        skipped_tokens = max(0, self._hit_end(hit_chunks, num_tokens) - window + 1)
        return skipped_tokens // block * block // self.layout.chunk_size

    def _promise(self, job: Verification, state: _Request, num_tokens: int) -> int:
        """What a settled read-back promises: its leading intact chunks, unless they end early
        (a failure, the deadline) and the window at that shorter end reaches chunks before the
        read-back began (not read back): then only what needed no read-back."""
        good, floor = job.good_chunks, state.verify_floor
        if good < job.end and state.state_keys:
            return floor  # A hybrid model's restore ends at its state, or does not happen.
        if good < job.end and job.first > floor and self._out_of_window(good, num_tokens) < job.first:
            return floor
        return good

    def _settled_chunks(self, job: Verification, state: _Request, num_tokens: int) -> int | None:
        """A read-back's promise once it is settled (counted then, once); None before."""
        if job.settled:
            return self._promise(job, state, num_tokens)
        if not job.settle(time.monotonic()):
            return None
        promised = self._promise(job, state, num_tokens)
        # Stored up to the first that failed (all of them, where the read-back was cut),
        # promised or not: recomputed, never stored again.
        state.saved_chunks = max(state.saved_chunks, job.first + len(job.items) if job.cut else job.good_chunks)
        self.counters.hit_chunks += promised
        self.counters.verified_chunks += job.verified
        if job.cut:
            self.counters.read_back_skipped_chunks += job.end - promised
            self._once.say(
                "read-back-cut",
                f"a read-back from a tier outside RAM was stopped after {job.verified} of {job.end - job.first} "
                "chunks: the rest would arrive slower than it recomputes (recomputed instead; said once; counted "
                "in read_back_skipped_chunks)",
                logging.INFO,
            )
            return promised
        self.counters.unverified_chunks += job.end - promised
        if job.failed:
            self._once.say(
                "read-back",
                "a stored chunk failed its read-back (damaged or of the wrong size): it is recomputed and stored "
                "again, never loaded (said once; counted in unverified_chunks)",
            )
        elif promised < job.end:
            self._once.say(
                "read-back-late",
                f"stored chunks were not read back within engine.verify_wait_ms {self.config.engine.verify_wait_ms}: "
                "recomputed, not restored (said once; counted in unverified_chunks)",
            )
        return promised

    def _hit_end(self, hit_chunks: int, num_tokens: int) -> int:
        """Where a load of ``hit_chunks`` stored chunks ends: one token short of the prompt,
        on a block boundary, so vLLM computes the last position itself."""
        block = self.layout.block_size
        return min(hit_chunks * self.layout.chunk_size, ((num_tokens - 1) // block) * block)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        block = self.layout.block_size
        per_chunk = self.layout.blocks_per_chunk
        block_ids = blocks.get_block_ids()
        start_block = state.local_tokens // block
        end_block = (state.local_tokens + num_external_tokens) // block
        assert state.local_tokens % block == 0 and num_external_tokens % block == 0, (
            state.local_tokens, num_external_tokens)  # fmt: skip
        first_chunk, last_chunk = start_block // per_chunk, -(-end_block // per_chunk)
        load = ChunkTransfer(
            request_id=request.request_id,
            keys=[keys[first_chunk:last_chunk] for keys in state.keys],
            block_ids=span(self._kv_blocks(block_ids), start_block, end_block),
            skip_blocks=start_block - first_chunk * per_chunk,
            asynchronous=self.asynchronous_loads,
            state=self._state_transfer(request.request_id, state, block_ids, last_chunk) if state.state_keys else None,
            recompute_s=(
                self.planner.chunk_recompute_s(state.local_tokens, state.local_tokens + num_external_tokens)
                if self.planner is not None
                else ()
            ),
        )
        state.load, state.load_first_chunk = load, first_chunk
        self._loads.append(load)

    def _kv_blocks(self, block_ids: GroupBlocks) -> GroupBlocks:
        """The attention groups' blocks of ``block_ids`` (every group's, in vLLM's order):
        those a chunk object holds."""
        return [block_ids[g.index] for g in self.layout.kv_groups]

    def _state_transfer(self, req_id: str, state: _Request, block_ids: GroupBlocks, chunks: int) -> ChunkTransfer:
        """The state at the end of chunk ``chunks - 1`` and the block of each Mamba-type group
        that holds it (vLLM keeps the state after ``k`` blocks in the block at index ``k - 1``)."""
        block = chunks * self.layout.blocks_per_chunk - 1
        return ChunkTransfer(
            request_id=req_id,
            keys=[keys[chunks - 1 : chunks] for keys in state.state_keys],
            block_ids=[[block_ids[g.index][block]] for g in self.layout.state_groups],
        )

    # -- each step ---------------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> KVHarborMetadata:
        meta = KVHarborMetadata(loads=self._loads)
        self._loads = []
        if self.link.is_off and not self._off_reason:
            self._off_reason = f"the scheduler's gateway link failed ({self.link.off_reason})"
        if self._off_reason and not self._off_sent:
            meta.cache_off, self._off_sent = self._off_reason, True
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_step(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = _resumed(cached)
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                state.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_blocks]
                for ids, added in zip(state.block_ids, new_blocks, strict=True):
                    ids.extend(added)
            self._plan_step(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        if not meta.loads:
            meta.step_flops = self._prefill_flops(scheduler_output)
        if not scheduled:
            self._wait_for_read_back()
        return meta

    def _wait_for_read_back(self) -> None:
        """An idle step (nothing scheduled: the engine only has requests waiting for their
        read-back) waits for one to finish, up to ``engine.verify_idle_wait_ms``.

        vLLM steps again at once, and a loop that keeps taking the interpreter back starves
        the verifier's thread of it: its request left 2 s late on a loaded machine, past the
        read-back's deadline. Waiting on the read-back's event lets that thread run now.
        """
        wait_s = self.config.engine.verify_idle_wait_ms / 1000
        pending = [s.verification for s in self._requests.values() if s.verification and not s.verification.settled]
        if wait_s > 0 and pending:
            first = min(pending, key=lambda job: job.deadline)
            first.done.wait(min(wait_s, max(0.0, first.deadline - time.monotonic())))

    def observe(self, stats: Any) -> None:
        """A step's stats from the workers (`update_connector_output`): learn the load
        bandwidth and the prefill rate, and whether some worker turned the cache off."""
        data = getattr(stats, "data", None)
        if not data:
            return
        # A worker reports its last save's commit with "none pending" in the same stats,
        # and only an empty report (nothing pending, nothing done) is left out: so this
        # turns false exactly when the last commit has been counted.
        self.saves_pending = bool(data.get("saves_pending"))
        if data.get("cache_off") and not self._off_reason:
            self._off_reason = "a worker reported it off"
            self._once.say(
                "workers-off",
                "the external KV cache is off on a worker: no more restores are planned, every rank turns it off",
            )
        if self.planner is not None:
            self.planner.observe_load(data.get("loaded_bytes", 0), data.get("load_seconds", 0))
            self.planner.observe_prefill(data.get("prefill_flops", 0), data.get("prefill_seconds", 0))

    def _read_back_timed(self, nbytes: int, seconds: float) -> None:
        """A read-back's bytes and seconds (the verifier's thread): the planner's read-back rate."""
        planner = self.planner
        if planner is not None:
            planner.observe_read_back(nbytes, seconds)

    def observe_load_errors(self, block_ids: set[int]) -> None:
        """Blocks whose load failed after all (a chunk damaged or evicted since its promise):
        vLLM recomputes from the first of them, and their chunks are saved again then."""
        if not block_ids:
            return
        per_chunk = self.layout.blocks_per_chunk
        for state in self._requests.values():
            load = state.load
            if load is None:
                continue
            failed = min(
                (i for ids in load.block_ids for i, block in enumerate(ids) if block in block_ids), default=None
            )
            if failed is not None:
                chunk = state.load_first_chunk + (load.skip_blocks + failed) // per_chunk
                state.saved_chunks = min(state.saved_chunks, chunk)
                state.load = None

    def observe_failed_loads(self, request_ids: set[str]) -> None:
        """Requests whose asynchronous load fell short (vLLM's ``failed_recving``): vLLM
        recomputes them from their start, they are not offered a load again, and their
        chunks from the load's first on are saved again from the recomputed KV."""
        for req_id in request_ids:
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.load_failed = True
            if state.load is not None:
                state.saved_chunks = min(state.saved_chunks, state.load_first_chunk)
                state.state_chunks = min(state.state_chunks, state.load_first_chunk)
                state.load = None

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Saves copy their blocks within the step, so blocks are never held back."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.verification is not None:
            state.verification.settle(float("inf"))  # Aborted while read back: stop there.
        self._skipped.discard(request.request_id)
        self._chose_recompute.discard(request.request_id)
        self._remeasuring.discard(request.request_id)
        return False, None

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()
        self.link.close()

    def take_stats(self) -> dict[str, float]:
        """What changed since the last call, in `stats` form; the cache state as it is now."""
        now = self.counters.snapshot()
        stats = empty()
        for name, value in now.items():
            stats[name] = value - self._reported[name]
        self._reported = now
        stats["cache_off"] = int(self.link.is_off)
        return stats

    # -- internals ---------------------------------------------------------------

    def _worth_loading(self, req_id: str, start: int, end: int, read_back_bytes: int = 0) -> bool:
        """Load tokens ``start .. end`` (``read_back_bytes`` of every rank's values read back
        into RAM first) rather than recompute them? vLLM may ask again for a request it could
        not schedule: a request counts once, and one chosen to re-measure the load rate keeps
        that answer (the planner starts one re-measurement a period)."""
        if self._off_reason:
            return False
        planner = self.planner
        if planner is None or req_id in self._remeasuring:
            return True
        size = self.layout.chunk_size
        decision = planner.choose(start, end, -(-end // size) - start // size, read_back_bytes)
        if decision.remeasure:
            self._remeasuring.add(req_id)
            self._once.say("remeasure", f"a stored prefix is restored: {decision.reason} (said once)", logging.INFO)
        if decision.load:
            return True
        if req_id not in self._chose_recompute:
            self._chose_recompute.add(req_id)
            self.counters.chose_recompute += 1
            planner.chose_recompute += 1
            _log.debug("kvharbor: request %s: %s", req_id, decision.reason)
            self._once.say(
                "recompute",
                f"a stored prefix of {end - start} tokens is recomputed, not restored ({decision.reason}; "
                "measured rates); said once, counted in chose_recompute",
                logging.INFO,
            )
        return False

    def _prefill_flops(self, scheduler_output: Any) -> float:
        """Prefill FLOPs of a step (prompt chunks only; decode tokens cost little and
        mostly memory time); 0 when too light to time."""
        if self.planner is None:
            return 0.0
        cost = self.planner.cost
        scheduled = scheduler_output.num_scheduled_tokens
        spans = [(new.num_computed_tokens, scheduled.get(new.req_id, 0)) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        spans += [(cached.num_computed_tokens[i], scheduled.get(r, 0)) for i, r in enumerate(cached.req_ids)]
        flops = sum(cost.flops(done, done + n) for done, n in spans if n > 1)
        return flops if flops >= PREFILL_SAMPLE_FLOPS_MIN else 0.0

    def _request(self, request: Any) -> _Request | None:
        """The request's state, computing its keys once; None when it is not cached."""
        state = self._requests.get(request.request_id)
        if state is not None or request.request_id in self._skipped:
            return state
        salt = getattr(request, "cache_salt", None)
        prompt = request.prompt_token_ids
        if salt is not None and not isinstance(salt, str):
            self.counters.bad_salt_skipped += 1
            self._once.say("bad-salt", f"cache_salt must be a string, got {type(salt).__name__}; request not cached")
        elif salt is None and self.config.engine.require_cache_salt:
            self.counters.unsalted_skipped += 1
            self._once.say(
                "unsalted",
                "engine.require_cache_salt is on: requests without a cache_salt are neither looked up nor stored",
                logging.INFO,  # Misses by the configuration's choice: news, not trouble.
            )
        elif prompt is not None:
            state = self._new_request(request.request_id, prompt, salt)
            state.max_tokens = getattr(request, "max_tokens", None)
            return state
        # Not cacheable (a bad or missing salt, or prompt embeddings without token ids).
        self._skipped.add(request.request_id)
        return None

    def _new_request(self, request_id: str, prompt: Any, salt: str | None) -> _Request:
        if len(prompt) < self.layout.chunk_size:
            self.counters.short_prompts += 1
        state = _Request(
            keys=self.layout.keys(prompt, salt),
            prompt_tokens=len(prompt),
            state_keys=self.layout.state_keys(prompt, salt),
        )
        self._requests[request_id] = state
        return state

    def _plan_step(self, meta: KVHarborMetadata, req_id: str, state: _Request, computed_after: int) -> None:
        """A scheduled request's part of the step's metadata: its saves, and whether the step
        gives its answer's last token (``max_tokens`` of them; vLLM computes every token but
        the answer's last: after the step ``computed_after - prompt_tokens + 1`` are out)."""
        self._plan_save(meta, req_id, state, computed_after)
        if state.max_tokens is not None and computed_after >= state.prompt_tokens + state.max_tokens - 1:
            meta.answered.append(req_id)

    def _plan_save(self, meta: KVHarborMetadata, req_id: str, state: _Request, computed_after: int) -> None:
        """Save the prompt chunks complete after this step that are not saved yet, and a
        hybrid model's state where the step ends on a chunk end whose state is not."""
        per_chunk = self.layout.blocks_per_chunk
        done = min(computed_after, state.prompt_tokens) // self.layout.chunk_size
        kv_blocks = self._kv_blocks(state.block_ids) if state.block_ids else []
        held = len(kv_blocks[0]) if kv_blocks else 0
        done = min(done, held // per_chunk, len(state.keys[0]))
        state_save = self._state_save(req_id, state, computed_after, done)
        if done <= state.saved_chunks and state_save is None:
            return
        first = min(state.saved_chunks, done)
        # Null blocks (they lead) are out of a sliding window: vLLM freed them, nothing is left
        # to save there. `check_sliding_window` keeps a step's new chunks clear of them.
        nulls = max(leading_nulls(ids) for ids in span(kv_blocks, first * per_chunk, done * per_chunk))
        if nulls:
            skipped = min(done, first + -(-nulls // per_chunk)) - first
            self.counters.window_unsaved += skipped
            self._once.say(
                "window-unsaved",
                f"{skipped} chunk(s) of request {req_id} had left the sliding window before they could be saved "
                "(counted in window_unsaved; the prompt's later chunks are then not reachable either)",
            )
            first += skipped
            state.saved_chunks = first
            if first >= done and state_save is None:
                return
        meta.saves.append(
            ChunkTransfer(
                request_id=req_id,
                keys=[keys[first:done] for keys in state.keys],
                block_ids=span(kv_blocks, first * per_chunk, done * per_chunk),
                state=state_save,
            )
        )
        state.saved_chunks = max(state.saved_chunks, done)

    def _state_save(self, req_id: str, state: _Request, computed_after: int, done: int) -> ChunkTransfer | None:
        """A hybrid model's state to store after this step: where the step ends on the end of
        chunk ``done - 1`` (vLLM's running state is then the state there) and no state is
        stored there or later. Chunks stored already do not stop it: a prompt recomputed
        for want of a state stores the one it lacked."""
        if not state.state_keys or done <= state.state_chunks or computed_after != done * self.layout.chunk_size:
            return None
        save = self._state_transfer(req_id, state, state.block_ids, done)
        if NULL_BLOCK in (ids[0] for ids in save.block_ids):
            return None  # vLLM holds no state there (not seen): nothing to store.
        state.state_chunks = done
        return save


def _resumed(cached: Any) -> set[str]:
    """Requests resumed from preemption this step (0.32: a set; 0.26: a flag list)."""
    ids = getattr(cached, "resumed_req_ids", None)
    if ids is not None:
        return set(ids)
    flags = getattr(cached, "resumed_from_preemption", None) or []
    return {req_id for req_id, flag in zip(cached.req_ids, flags, strict=False) if flag}
