"""The GPU data path: paged KV blocks <-> the gateway's shared memory at PCIe speed.

Bytes take the shortest road between vLLM's paged GPU cache and the
gateway's shared-memory segment:

- **page-locked shared memory.** The worker's mappings of the segment are
  registered with CUDA (``cudaHostRegister``), so every copy to or from them
  is a DMA by the copy engines, never a pageable copy through a driver bounce
  buffer. If a mapping cannot be registered the external cache is turned off
  on this rank with one clear log line; the engine keeps serving.
- **one contiguous copy per run of chunks.** A chunk's blocks are scattered
  over the cache, so they are gathered on the GPU (``index_select`` per layer)
  into a contiguous staging buffer and cross PCIe in one device-to-host copy
  per run of chunks that lie next to each other in shared memory; loads cross
  in one host-to-device copy per run and are scattered into their blocks with
  ``index_copy_``. Device-to-device traffic is ~4 TB/s, so the gather and the
  scatter cost a few percent of the PCIe time they save.
- **own streams, overlapped.** Host-to-device copies, scatters, gathers and
  device-to-host copies each run on a stream of their own, ordered by events:
  a load's copy of request n+1 overlaps the scatter of request n and the
  gateway reading request n+2 (`CacheLink.load_streamed`); a save's gathers
  run layer by layer during the forward pass (``save_kv_layer``) and its
  device-to-host copy runs behind the engine, on the saver thread, overlapped
  with the next steps. The engine's stream waits for a layer's loads only
  where that layer needs them (``wait_for_layer_load``) and for a step's
  gathers only at the end of the step (the blocks may be reused after it).

Stored bytes are each block's memory as it lies (`block_major`), so a
permuted layout (flash-attn's NHD stride order) costs no transposition. The
CPU backend keeps its own path (`pages.PageCopier`). Every class here also
runs on CPU tensors (streams and events become no-ops), which is how CI,
without a GPU, tests the logic.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

import torch

from kvharbor.cache.bandwidth import keep_loading
from kvharbor.connector.vllm.layout import ConnectorRefusal
from kvharbor.connector.vllm.pages import find_block_dim
from kvharbor.gateway.shm import ShmUnavailable, address_of
from kvharbor.telemetry.log import OnceLog, get_logger

if TYPE_CHECKING:  # Importable without vLLM (bench/gpu.py's data-path part needs none).
    from kvharbor.connector.link import CacheLink
    from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata

_log = get_logger("kvharbor.connector.vllm")

MIB = 1 << 20
LOAD_BATCH_BYTES = 256 * MIB
"""Bytes asked of the gateway per load request, and the size of each of the two device
staging slots loads pass through (two: one is copied in while the other is scattered)."""
SAVE_STAGING_BYTES_MAX = 4096 * MIB
"""Device memory that saves still waiting for their device-to-host copy may hold."""
SAVE_STAGING_WAIT_S = 5.0
"""How long a step waits for staging room before its saves are skipped (a future miss)."""
STALL_S = 0.005
"""A step that waited longer than this for staging is not timed as a prefill sample."""

Wait = Callable[[], None]


def _no_wait() -> None:
    pass


class PinError(Exception):
    """Shared memory could not be page-locked for the GPU."""


def cuda_host_register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for CUDA; raises `PinError` with CUDA's reason."""
    try:
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    except (RuntimeError, AttributeError, OSError) as err:
        raise PinError(f"cudaHostRegister is not available: {err}") from None
    code = int(getattr(error, "value", error))
    if code != 0:
        name = getattr(error, "name", "")
        raise PinError(f"cudaHostRegister({nbytes >> 20} MiB) failed with CUDA error {code} {name}".rstrip())


def cuda_host_unregister(address: int) -> None:
    with contextlib.suppress(RuntimeError, AttributeError, OSError):
        torch.cuda.cudart().cudaHostUnregister(address)


Register = Callable[[int, int], None]
Unregister = Callable[[int], None]


class PinnedMapping:
    """One mapping of the gateway's segment, page-locked for the GPU while this lives.

    ``tensor`` is the whole mapping as bytes; a value's place in it is
    ``offset(view)``. The tensor does not export the segment's memoryview, so
    the client can unmap it once `close` has run.
    """

    def __init__(
        self,
        view: memoryview,
        register: Register | None = cuda_host_register,
        unregister: Unregister = cuda_host_unregister,
    ) -> None:
        """Register all of ``view`` for reads and writes: the GPU reads hits from the
        RAM tiers in place and writes puts into them in place. It must be writable
        (CUDA pins pages for writing only in a writable mapping)."""
        self.base = address_of(view)
        self.size = view.nbytes
        self._registered: int | None = None
        self._unregister = unregister
        started = time.perf_counter()
        if register is not None:
            register(self.base, self.size)  # Raises PinError.
            self._registered = self.base
        self.register_s = time.perf_counter() - started
        array = (ctypes.c_uint8 * self.size).from_address(self.base)
        self.tensor = torch.frombuffer(array, dtype=torch.uint8)

    def offset(self, view: memoryview) -> int:
        offset = address_of(view) - self.base
        assert offset >= 0 and offset + view.nbytes <= self.size, (offset, view.nbytes, self.size)
        return offset

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._registered is not None:
            self._unregister(self._registered)
            self._registered = None


def block_major(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of ``tensor`` indexed by block first, each block's elements in memory order.

    The dims after the block dim are sorted by stride and merged where dense,
    so flash-attn's ``(blocks, heads, tokens, 2*head)`` with an NHD stride order
    becomes ``(blocks, page)``: a gathered page is a plain copy of the block's
    memory, with no transposition.
    """
    dim = find_block_dim(tensor, num_blocks)
    others = sorted((d for d in range(tensor.dim()) if d != dim), key=lambda d: -tensor.stride()[d])
    view = tensor.permute(dim, *others)
    shape: list[int] = []
    strides: list[int] = []
    for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True):
        if size == 1:
            continue
        if shape and strides[-1] == stride * size:
            shape[-1] *= size
            strides[-1] = stride
        else:
            shape.append(size)
            strides.append(stride)
    if not shape:
        shape, strides = [1], [1]
    return view.as_strided((num_blocks, *shape), (view.stride(0), *strides))


def contiguous_runs(offsets: Sequence[int], size: int) -> Iterator[tuple[int, int, int]]:
    """(first index, count, first offset) of each run of values that lie back to back."""
    start = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + size:
            yield start, i - start, offsets[start]
            start = i


# -- streams and events, or nothing on the CPU -------------------------------------


def _stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream: Any, timing: bool = False) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


def _current(device: torch.device) -> Any:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _await(stream: Any, event: Any) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _sync(event: Any) -> None:
    if event is not None:
        event.synchronize()


@dataclass(slots=True)
class StepSave:
    """One step's saves: the chunks' pages, gathered layer by layer into staging."""

    chunks: int
    ids: torch.Tensor
    """Block ids, ``blocks_per_chunk`` per chunk, on the device."""
    staging: torch.Tensor
    """``(chunks, layers, blocks_per_chunk, page)``: chunk c is the bytes it is stored as."""
    gathered: list[bool]
    nbytes: int
    ready: Any = None
    """Event: every layer gathered."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(chunk, offset in shared memory) of the device-to-host copies to make."""


class GpuPages:
    """Moves whole chunks between the paged KV cache tensors and pinned shared memory."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        load_batch_bytes: int = LOAD_BATCH_BYTES,
        save_staging_bytes_max: int = SAVE_STAGING_BYTES_MAX,
    ) -> None:
        assert tensors and blocks_per_chunk > 0
        self.layers = [block_major(t, num_blocks) for t in tensors]
        first = self.layers[0]
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        for layer in self.layers:
            if tuple(layer.shape[1:]) != self.page_shape or layer.dtype != self.dtype:
                raise ConnectorRefusal(
                    f"KV cache tensors differ in page shape or dtype ({tuple(layer.shape[1:])} {layer.dtype} vs "
                    f"{self.page_shape} {self.dtype}); the connector exchanges uniform layers only"
                )
        self.device = first.device
        self.page_elems = prod(self.page_shape)
        self.page_bytes = self.page_elems * first.element_size()
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = len(self.layers) * blocks_per_chunk * self.page_bytes
        self.chunks_per_load = max(1, load_batch_bytes // self.chunk_bytes)
        self.save_staging_bytes_max = max(save_staging_bytes_max, self.chunk_bytes)
        self._h2d = _stream(self.device)
        self._scatter = _stream(self.device)
        self._gather = _stream(self.device)
        self._d2h = _stream(self.device)
        self._slots: list[torch.Tensor] = []
        self._slot_free: list[Any] = [None, None]
        self._next_slot = 0
        self._staged: list[tuple[int, int, list[int]]] = []
        """Chunks of the load request being staged: (offset, first block, block ids)."""
        self._layer_ready: list[Any] = []
        """Per layer, the event after its latest scatter (CUDA only)."""
        self._staging_bytes = 0
        self._staging = threading.Condition()

    # -- loads: shared memory -> staging -> blocks ------------------------------------

    def stage_load(self, mapping: PinnedMapping, view: memoryview, first: int, block_ids: Sequence[int]) -> None:
        """Add a stored chunk to the load request in progress: its blocks ``first ..
        first + len(block_ids)`` go to ``block_ids``."""
        assert view.nbytes == self.chunk_bytes, (view.nbytes, self.chunk_bytes)
        assert first >= 0 and first + len(block_ids) <= self.blocks_per_chunk, (first, len(block_ids))
        assert len(self._staged) < self.chunks_per_load, "flush_load after chunks_per_load chunks"
        self._staged.append((mapping.offset(view), first, list(block_ids)))

    def flush_load(self, mapping: PinnedMapping) -> Wait:
        """Copy the staged chunks in and scatter them; the returned wait blocks until
        their shared memory has been read (and may be given back)."""
        staged, self._staged = self._staged, []
        if not staged:
            return _no_wait
        if not self._slots:
            self._slots = [
                torch.empty(self.chunks_per_load * self.chunk_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
        index = self._next_slot
        self._next_slot = (index + 1) % len(self._slots)
        slot = self._slots[index]
        size = self.chunk_bytes
        # The blocks may have been another request's until now: scatter after the engine's
        # work queued so far, which may still write them.
        engine = _record(_current(self.device))
        with _on(self._h2d):
            _await(self._h2d, self._slot_free[index])
            for at, count, offset in contiguous_runs([s[0] for s in staged], size):
                source = mapping.tensor[offset : offset + count * size]
                slot[at * size : (at + count) * size].copy_(source, non_blocking=True)
            copied = _record(self._h2d)
        chunk_index: list[int] = []
        block_index: list[int] = []
        targets: list[int] = []
        for c, (_, first, block_ids) in enumerate(staged):
            chunk_index += [c] * len(block_ids)
            block_index += range(first, first + len(block_ids))
            targets += block_ids
        with _on(self._scatter):
            _await(self._scatter, engine)
            _await(self._scatter, copied)
            pages = slot[: len(staged) * size].view(self.dtype).view(len(staged), len(self.layers), -1, self.page_elems)
            c_index = self._index(chunk_index)
            b_index = self._index(block_index)
            t_index = self._index(targets)
            ready = []
            for layer_index, layer in enumerate(self.layers):
                rows = pages[c_index, layer_index, b_index]
                layer.index_copy_(0, t_index, rows.view(len(targets), *self.page_shape))
                ready.append(_record(self._scatter))
            self._slot_free[index] = ready[-1]
            if self._scatter is not None:
                self._layer_ready = ready
        return lambda: _sync(copied)

    def wait_layer(self, layer_index: int) -> None:
        """Make the engine's stream wait for the loads into one layer."""
        if self._layer_ready:
            _await(_current(self.device), self._layer_ready[layer_index])

    def wait_loads(self) -> None:
        """Make the engine's stream wait for every load so far (end of a step)."""
        if self._layer_ready:
            _await(_current(self.device), self._layer_ready[-1])
            self._layer_ready = []

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    # -- saves: blocks -> staging (during the forward) -> shared memory (behind it) ----

    def open_save(self, block_ids: Sequence[Sequence[int]], wait_s: float = SAVE_STAGING_WAIT_S) -> StepSave | None:
        """Staging for the given chunks' blocks (``blocks_per_chunk`` each); the chunks
        that fit in `SAVE_STAGING_BYTES_MAX`, after waiting up to ``wait_s`` for room.
        None: no room came; this step's saves are skipped."""
        fits = self.save_staging_bytes_max // self.chunk_bytes
        chunks = min(len(block_ids), fits)
        if chunks <= 0:
            return None
        nbytes = chunks * self.chunk_bytes
        with self._staging:
            room = self._staging.wait_for(
                lambda: self._staging_bytes + nbytes <= self.save_staging_bytes_max, timeout=wait_s
            )
            if not room:
                return None
            self._staging_bytes += nbytes
        flat = [b for ids in block_ids[:chunks] for b in ids]
        assert len(flat) == chunks * self.blocks_per_chunk, (len(flat), chunks)
        try:
            with _on(self._gather):
                ids = self._index(flat)
                staging = torch.empty(
                    (chunks, len(self.layers), self.blocks_per_chunk, self.page_elems),
                    dtype=self.dtype,
                    device=self.device,
                )
        except torch.OutOfMemoryError:
            self._give_back(nbytes)
            return None
        return StepSave(chunks, ids, staging, [False] * len(self.layers), nbytes)

    def gather_layer(self, save: StepSave, layer_index: int) -> None:
        """Gather one layer's pages of the step's chunks, behind the engine's stream
        (call it once the forward pass has written that layer)."""
        if save.gathered[layer_index]:
            return
        written = _record(_current(self.device))
        with _on(self._gather):
            _await(self._gather, written)
            pages = self.layers[layer_index].index_select(0, save.ids)
            save.staging[:, layer_index].copy_(pages.view(save.chunks, self.blocks_per_chunk, self.page_elems))
        save.gathered[layer_index] = True

    def close_save(self, save: StepSave) -> None:
        """End of the step: gather the layers the forward pass did not report, and make
        the engine's stream wait for the gathers (the blocks may be reused after it)."""
        for layer_index, done in enumerate(save.gathered):
            if not done:
                self.gather_layer(save, layer_index)
        save.ready = _record(self._gather)
        _await(_current(self.device), save.ready)

    def stage_save(self, save: StepSave, chunk: int, mapping: PinnedMapping, view: memoryview) -> None:
        assert view.nbytes == self.chunk_bytes and 0 <= chunk < save.chunks
        save.copies.append((chunk, mapping.offset(view)))

    def flush_save(self, save: StepSave, mapping: PinnedMapping) -> Wait:
        """Start copying the staged chunks to shared memory (on the saver thread, not the
        engine's); the returned wait blocks until they are there."""
        copies, save.copies = save.copies, []
        if not copies:
            return _no_wait
        size = self.chunk_bytes
        staged = save.staging.view(torch.uint8).view(save.chunks, size)
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device, _on(self._d2h):
            _await(self._d2h, save.ready)
            order = sorted(copies, key=lambda c: c[1])
            chunks = [c for c, _ in order]
            for at, count, offset in contiguous_runs([o for _, o in order], size):
                first = chunks[at]
                if chunks[at : at + count] == list(range(first, first + count)):
                    mapping.tensor[offset : offset + count * size].copy_(
                        staged[first : first + count].view(-1), non_blocking=True
                    )
                else:
                    for k in range(count):
                        target = mapping.tensor[offset + k * size : offset + (k + 1) * size]
                        target.copy_(staged[chunks[at + k]], non_blocking=True)
            done = _record(self._d2h)
        return lambda: _sync(done)

    def release_save(self, save: StepSave) -> None:
        """Give a step's staging back (after its copies, or when they are abandoned)."""
        if save.nbytes:
            _sync(save.ready)
            nbytes, save.nbytes = save.nbytes, 0
            save.staging = save.ids = torch.empty(0, device=self.device)
            self._give_back(nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._staging:
            self._staging_bytes -= nbytes
            assert self._staging_bytes >= 0
            self._staging.notify_all()

    @property
    def staging_bytes(self) -> int:
        return self._staging_bytes

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._slots = []
        self._layer_ready = []


class StepTimer:
    """Times the engine's forward passes between `begin` and `end` of a step.

    On a GPU with events recorded on the engine's stream, read once they have
    completed (never a synchronisation); on the CPU, with the wall clock, the
    forward pass being synchronous there.
    """

    PENDING_MAX = 64

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start: Any = None
        self._pending: list[tuple[Any, Any, float]] = []

    def begin(self) -> None:
        if self.device.type == "cuda":
            self._start = _record(_current(self.device), timing=True)
        else:
            self._start = time.perf_counter()

    def end(self, flops: float) -> None:
        start, self._start = self._start, None
        if start is None or flops <= 0:
            return
        if self.device.type == "cuda":
            if len(self._pending) < self.PENDING_MAX:
                self._pending.append((start, _record(_current(self.device), timing=True), flops))
        else:
            self._pending.append((start, time.perf_counter(), flops))

    def cancel(self) -> None:
        self._start = None

    def take(self) -> tuple[float, float]:
        """(FLOPs, seconds) of the timed steps that have completed since the last call."""
        flops = seconds = 0.0
        keep = []
        for start, end, step_flops in self._pending:
            if self.device.type != "cuda":
                flops, seconds = flops + step_flops, seconds + (end - start)
            elif end.query():
                flops, seconds = flops + step_flops, seconds + start.elapsed_time(end) / 1000
            else:
                keep.append((start, end, step_flops))
        self._pending = keep
        return flops, seconds


@dataclass(frozen=True, slots=True)
class SaveParts:
    """What the saver thread needs to store one step's staged chunks."""

    keys: list[bytes]
    fill: Callable[[int, memoryview], None]
    """Stage value i's copy into the view the gateway lent."""
    settle: Callable[[], None]
    """Make the staged copies and wait for them (before the commit)."""
    done: Callable[[], None]
    """Give the staging back (always called, also when the store failed)."""


class GpuWorkerPath:
    """A vLLM worker's GPU half: pins its links' shared memory, restores chunks
    into the paged cache, and stages each step's saves layer by layer.

    ``count(**deltas)`` adds to the worker's stats.
    """

    def __init__(
        self,
        pages: GpuPages,
        layer_names: Sequence[str],
        load_link: CacheLink,
        save_link: CacheLink,
        rank: int,
        fingerprint: bytes,
        count: Callable[..., None],
        register: Register | None = cuda_host_register,
    ) -> None:
        self.pages = pages
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.rank = rank
        self.fingerprint = fingerprint
        self._load_link = load_link
        self._save_link = save_link
        self._count = count
        self._register = register
        self.pins: list[PinnedMapping] = []
        """The load link's mapping, then the save link's; empty when not pinned (cache off)."""
        self._meta: KVHarborMetadata | None = None
        self._save: StepSave | None = None
        self._save_keys: list[bytes] = []
        self._save_opened = False
        self.stalled = False
        """This step's forward pass waited for save staging (so it is no prefill sample)."""
        self._once = OnceLog(_log)

    def pin(self) -> bool:
        """Page-lock both links' shared memory; on failure the cache goes off on this rank."""
        started = time.perf_counter()
        try:
            for link in (self._load_link, self._save_link):
                segment = link.shared_memory()
                if segment is None:
                    self._unpin()
                    return False  # The cache is off already; the link said why.
                segment.make_writable()  # Written by DMA only: see `Segment.make_writable`.
                self.pins.append(PinnedMapping(segment.view, self._register))
        except (PinError, ShmUnavailable) as err:
            self._unpin()
            reason = f"the gateway's shared memory cannot be page-locked for the GPU: {err}"
            _log.error(
                "kvharbor: %s. The external KV cache is off on this rank (no pageable copies on the hot "
                "path); the engine keeps serving. Check the locked-memory limit (ulimit -l, container "
                "memlock) and that gateway.shm_dir is a tmpfs",
                reason,
            )
            self._load_link.switch.turn_off(reason)
            return False
        _log.info(
            "kvharbor: shared memory page-locked for the GPU (%d mapping(s) of %d MiB in %.2f s); "
            "%.1f MiB per chunk, %d chunk(s) per load request",
            len(self.pins), self.pins[0].size >> 20, time.perf_counter() - started,
            self.pages.chunk_bytes / MIB, self.pages.chunks_per_load,
        )  # fmt: skip
        return True

    def _unpin(self) -> None:
        for pin in self.pins:
            pin.close()
        self.pins = []

    # -- loads -----------------------------------------------------------------

    def load(self, transfer: ChunkTransfer) -> int:
        """Restore the leading stored chunks of ``transfer``; returns the blocks restored."""
        if not self.pins:
            return 0
        pin, pages = self.pins[0], self.pages
        per, size = pages.blocks_per_chunk, pages.chunk_bytes
        keys = transfer.keys[self.rank]
        block_ids, skip = transfer.block_ids, transfer.skip_blocks
        accepted: list[int] = []

        def sink(i: int, view: memoryview) -> None:
            if view.nbytes != size or len(accepted) != i:
                return  # Another layout's bytes, or a gap: restore nothing more.
            first = skip if i == 0 else 0
            start = 0 if i == 0 else i * per - skip
            take = min(per - first, len(block_ids) - start)
            if take > 0:
                pages.stage_load(pin, view, first, block_ids[start : start + take])
                accepted.append(take)

        started = time.perf_counter()

        def proceed(done: int) -> bool:
            if len(accepted) < done:
                return False
            left = transfer.recompute_s[done:] if transfer.recompute_s else None
            go = keep_loading(
                time.perf_counter() - started, done * size, (len(keys) - done) * size, sum(left) if left else None
            )
            if not go:
                self._count(loads_cut=1)
                self._once.say(
                    "cut",
                    f"a restore was stopped after {done} of {len(keys)} chunks: at the "
                    f"{done * size / (time.perf_counter() - started) / 1e9:.2f} GB/s it got, the rest "
                    "arrives slower than it recomputes (recomputed instead; said once)",
                    20,
                )
            return go

        chunks = self._load_link.load_streamed(
            self.fingerprint, keys, pages.chunks_per_load, sink, lambda: pages.flush_load(pin), proceed
        )
        restored = min(chunks, len(accepted))
        self._count(loaded_chunks=restored, loaded_bytes=restored * size)
        return sum(accepted[:restored])

    def wait_layer(self, layer_name: str) -> None:
        index = self.layer_index.get(layer_name)
        if index is not None:
            self.pages.wait_layer(index)

    # -- saves -----------------------------------------------------------------

    def begin_step(self, meta: KVHarborMetadata) -> None:
        self.pages.wait_loads()
        self._meta = meta
        self._save, self._save_keys, self._save_opened = None, [], False
        self.stalled = False

    def save_layer(self, layer_name: str) -> None:
        """The forward pass has written this layer: gather its pages of the step's chunks."""
        meta = self._meta
        if meta is None or not meta.saves:
            return
        if not self._save_opened:
            self._open_save(meta)
        index = self.layer_index.get(layer_name)
        if self._save is not None and index is not None:
            self.pages.gather_layer(self._save, index)

    def end_step(self, meta: KVHarborMetadata) -> SaveParts | None:
        """End of the step's forward pass: finish the gathers; what the saver thread stores."""
        self.pages.wait_loads()
        if meta.saves and not self._save_opened:
            self._open_save(meta)
        save, keys = self._save, self._save_keys
        self._meta, self._save, self._save_keys, self._save_opened = None, None, [], False
        if save is None:
            return None
        self.pages.close_save(save)
        pin, pages = self.pins[1], self.pages
        return SaveParts(
            keys,
            fill=lambda i, view: pages.stage_save(save, i, pin, view),
            settle=lambda: pages.flush_save(save, pin)(),
            done=lambda: pages.release_save(save),
        )

    def _open_save(self, meta: KVHarborMetadata) -> None:
        self._save_opened = True
        if len(self.pins) < 2 or self._save_link.is_off:
            return
        per = self.pages.blocks_per_chunk
        keys: list[bytes] = []
        blocks: list[Sequence[int]] = []
        for transfer in meta.saves:
            for i, key in enumerate(transfer.keys[self.rank]):
                keys.append(key)
                blocks.append(transfer.block_ids[i * per : (i + 1) * per])
        started = time.perf_counter()
        save = self.pages.open_save(blocks)
        self.stalled = time.perf_counter() - started > STALL_S
        kept = save.chunks if save is not None else 0
        if kept < len(keys):
            self._count(save_dropped=len(keys) - kept)
            self._once.say(
                "staging",
                f"{len(keys) - kept} of a step's {len(keys)} chunks not saved: device staging for saves "
                f"is full ({self.pages.staging_bytes >> 20} MiB of {self.pages.save_staging_bytes_max >> 20} MiB "
                "waiting for the storage); they will be misses (said once)",
            )
        self._save, self._save_keys = save, keys[:kept]

    def close(self) -> None:
        self.pages.close()
        self._unpin()
