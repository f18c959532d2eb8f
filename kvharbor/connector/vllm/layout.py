"""What vLLM's configuration says about the bytes of a stored chunk.

Both halves of the connector build the same `VllmLayout` from the same inputs
(the engine's config and its KV cache config), so the scheduler can compute
the keys that the workers store under. Everything that changes the bytes of a
chunk enters the fingerprint: a different model, dtype, block size, chunk
size, parallel layout, KV cache spec or device never shares a key.

Checks that make the connector refuse to start live here too: a cache it
cannot exchange is named, with the setting that fixes it, rather than being
silently left uncached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvharbor.cache.keys import ChunkKey, LayoutFingerprint, chunk_keys, max_hit_tokens
from kvharbor.config import Config


class ConnectorRefusal(Exception):
    """The connector cannot run with this engine configuration; the text says why and what to change."""


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One KV cache group as the connector sees it."""

    index: int
    kind: str
    """The vLLM spec class name: FullAttentionSpec, SlidingWindowSpec, MambaSpec, ..."""
    layer_names: tuple[str, ...]
    page_bytes: int
    descriptor: str
    block_size: int
    """Tokens per block of this group."""
    sliding_window: int | None = None
    """Tokens a layer of a sliding-window group attends to; None for the other kinds."""
    state_page_bytes: int = 0
    """A Mamba-type group's state per layer without vLLM's padding (what its registered
    tensor holds per block); 0 for attention groups."""

    @property
    def holds_state(self) -> bool:
        """A Mamba-type group: a block holds one recurrent state, not the KV of its tokens."""
        return self.kind in _STATE_KINDS


def describe_groups(kv_cache_config: Any) -> list[CacheGroup]:
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        fields = [f"bs={spec.block_size}", f"page={spec.page_size_bytes}"]
        for name in ("num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window", "kv_quant_mode"):
            value = getattr(spec, name, None)
            if value is not None:
                fields.append(f"{name}={value}")
        descriptor = f"{kind}[{len(group.layer_names)}]({','.join(fields)})"
        window = getattr(spec, "sliding_window", None) if kind == SLIDING_WINDOW else None
        if kind in _STATE_KINDS:
            fields.append(f"mode={getattr(spec, 'mamba_cache_mode', None)}")
            descriptor = f"{kind}[{len(group.layer_names)}]({','.join(fields)},state={_state_bytes(spec)})"
        groups.append(
            CacheGroup(
                index,
                kind,
                tuple(group.layer_names),
                int(spec.page_size_bytes),
                descriptor,
                int(spec.block_size),
                None if window is None else int(window),
                _state_bytes(spec) if kind in _STATE_KINDS else 0,
            )
        )
    return groups


def _state_bytes(spec: Any) -> int:
    """The bytes of one Mamba-type state: every state tensor of it (``spec.shapes``, ``spec.dtypes``)."""
    return sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        raise ConnectorRefusal(f"a Mamba-type state of dtype {dtype!r}: its size is unknown")
    return int(size)


def smallest_window(groups: Sequence[CacheGroup]) -> int | None:
    """The smallest sliding window of ``groups`` in tokens; None without sliding-window groups."""
    return min((g.sliding_window for g in groups if g.sliding_window is not None), default=None)


def restore_reach(groups: Sequence[CacheGroup]) -> int | None:
    """How far back from its end a restore reads, in tokens: the largest sliding window when
    every attention group has one; None (from the start) when some group attends to every
    token. A Mamba-type group reads only the state at the end."""
    windows = [g.sliding_window for g in groups if not g.holds_state]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


SLIDING_WINDOW = "SlidingWindowSpec"
_STATE_KINDS = frozenset({"MambaSpec"})
"""Spec kinds whose block holds a recurrent state (Mamba, Mamba-2, Gated DeltaNet, ...:
vLLM gives them all `MambaSpec`, told apart by ``mamba_type``)."""
_EXCHANGEABLE = {"FullAttentionSpec", SLIDING_WINDOW, *_STATE_KINDS}
"""Spec kinds whose pages the connector knows how to store and restore."""


def check_groups(
    groups: Sequence[CacheGroup], vllm_config: Any, num_gpu_blocks: int, chunk_size: int, block_size: int
) -> None:
    """Refuse, naming the cache, when a group cannot be exchanged safely. A cache the
    connector cannot exchange is named first: no other advice would let it start."""
    foreign = [g for g in groups if g.kind not in _EXCHANGEABLE]
    if foreign:
        first: dict[str, CacheGroup] = {}
        for group in foreign:
            first.setdefault(group.kind, group)
        names = "; ".join(f"group {g.index} {g.kind} (layer {g.layer_names[0]})" for g in first.values())
        raise ConnectorRefusal(
            f"KV cache registry: {len(foreign)} of {len(groups)} cache group(s) have no writer the connector "
            f"can reach; first of each kind: {names}. kvharbor exchanges full-attention, sliding-window and "
            "Mamba-type caches only (tell us the model and this line)"
        )
    mamba = [g for g in groups if g.holds_state]
    if mamba:
        check_state_groups(groups, vllm_config, num_gpu_blocks)
    pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if len(groups) > 1 and pp_size > 1:
        raise ConnectorRefusal(
            f"pipeline parallelism {pp_size} with {len(groups)} KV cache groups "
            f"({', '.join(f'group {g.index} {g.kind}' for g in groups)}): kvharbor exchanges several groups "
            "only with --pipeline-parallel-size 1"
        )
    # A stored chunk is every group's pages of the same block positions (`chunks.GroupBlocks`).
    other = [g for g in groups if g.block_size != block_size]
    if other:
        sizes = ", ".join(f"group {g.index} {g.kind} {g.block_size}" for g in other)
        raise ConnectorRefusal(
            f"KV cache groups with blocks of another size than --block-size {block_size} ({sizes} tokens): "
            "kvharbor exchanges groups whose blocks hold the same tokens (tell us the model and this line)"
        )
    for group in groups:
        if group.kind == SLIDING_WINDOW:
            check_sliding_window(group, vllm_config, chunk_size)


def check_sliding_window(group: CacheGroup, vllm_config: Any, chunk_size: int) -> None:
    """A sliding-window group is stored as full attention is, chunk by chunk, in the step that
    computes the chunk; vLLM frees a request's blocks that fall out of the window as it goes
    (their place in the request's block table becomes the null block). A save reads blocks
    that are live only while all of that holds:

    - the chunk fits the window: a chunk completed by a step began at most chunk_size - 1
      tokens before the step, and vLLM keeps the last window - 1 tokens before it;
    - the save has read them before vLLM schedules again: asynchronous scheduling frees and
      hands out blocks for the next step while this one runs.

    Beside full-attention groups (vLLM's hybrid allocator), a chunk's object holds the
    window group's pages too, so a restore reads them for every chunk and copies them only
    into the blocks vLLM allocated (those in the window at the restore's end).
    """
    window = group.sliding_window
    if window is None or window < chunk_size:
        raise ConnectorRefusal(
            f"sliding-window group {group.index} (window {window} tokens): engine.chunk_size {chunk_size} is larger "
            "than the window, so a chunk's first blocks could leave the window before the chunk is saved; set "
            "engine.chunk_size to a multiple of the block size no larger than the window (left unset, kvharbor "
            "chooses one)"
        )
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise ConnectorRefusal(
            f"sliding-window group {group.index} (window {window} tokens): with asynchronous scheduling vLLM may "
            "free blocks that fall out of the window and give them to another request while a save still reads "
            "them; start vLLM with --no-async-scheduling"
        )


def check_state_groups(groups: Sequence[CacheGroup], vllm_config: Any, num_gpu_blocks: int) -> None:
    """A Mamba-type group is exchanged as one state per chunk boundary (`VllmLayout.state_bytes`),
    which exists only where vLLM keeps states at block boundaries: in ``align`` mode, with
    prefix caching on (vLLM otherwise keeps only each request's running state)."""
    mamba = [g for g in groups if g.holds_state]
    first = mamba[0]
    if all(g.holds_state for g in groups):
        raise ConnectorRefusal(
            f"every KV cache group holds a Mamba-type state (group {first.index} {first.kind}): kvharbor restores a "
            "state together with the attention KV of the same tokens, and this model has none"
        )
    cache = vllm_config.cache_config
    # First: without prefix caching vLLM also leaves the mode at none (0.32 turns none into
    # align where prefix caching is on; 0.26 has an "all" mode beside them).
    if not getattr(cache, "enable_prefix_caching", False):
        raise ConnectorRefusal(
            f"Mamba-type group {first.index} ({first.kind}) without prefix caching: vLLM then keeps no state at "
            "block boundaries to store; start vLLM with --enable-prefix-caching"
        )
    mode = getattr(cache, "mamba_cache_mode", None)
    if mode != "align":
        raise ConnectorRefusal(
            f"Mamba-type group {first.index} ({first.kind}, layer {first.layer_names[0]}) with --mamba-cache-mode "
            f"{mode}: kvharbor stores a state per chunk boundary, which vLLM keeps only in align mode; start vLLM "
            "with --mamba-cache-mode align"
        )
    watermark = float(getattr(vllm_config.scheduler_config, "watermark", 0.0) or 0.0)
    check_mamba_reserve(len(mamba), watermark, num_gpu_blocks)


def check_mamba_reserve(mamba_groups: int, watermark: float, num_gpu_blocks: int) -> None:
    """Hybrid models need int(watermark x num_gpu_blocks) >= number of Mamba groups free
    at admission: each Mamba group takes one block for a restored state that vLLM's
    admission check does not count."""
    reserve = int(watermark * num_gpu_blocks)
    if reserve < mamba_groups:
        needed = mamba_groups / max(num_gpu_blocks, 1)
        raise ConnectorRefusal(
            f"this hybrid model has {mamba_groups} Mamba group(s) but the admission reserve "
            f"int(watermark {watermark} x {num_gpu_blocks} blocks) = {reserve} is smaller: restored requests "
            f"would stop with 'Cannot get N free blocks'. Start vLLM with --watermark={max(0.02, needed):.4g} "
            f"or more (W >= {mamba_groups} / {num_gpu_blocks})"
        )


@dataclass(frozen=True, slots=True)
class VllmLayout:
    chunk_size: int
    block_size: int
    tp_size: int
    pp_size: int
    fingerprints: tuple[LayoutFingerprint, ...]
    """One per rank, indexed by `rank_index`: of the chunk objects (attention KV)."""
    digests: tuple[bytes, ...]
    groups: tuple[CacheGroup, ...]
    state_digests: tuple[bytes, ...] = ()
    """One per rank: the fingerprint digests of the state objects (every Mamba-type group's
    state at a chunk boundary); empty without Mamba-type groups."""
    kv_groups: tuple[CacheGroup, ...] = field(init=False, repr=False, compare=False)
    """The attention groups, whose pages of a chunk's blocks make its chunk object."""
    state_groups: tuple[CacheGroup, ...] = field(init=False, repr=False, compare=False)
    """The Mamba-type groups, whose state at a chunk's end makes its state object."""

    def __post_init__(self) -> None:
        # Split once: the lookups and every step's plans ask for them.
        object.__setattr__(self, "kv_groups", tuple(g for g in self.groups if not g.holds_state))
        object.__setattr__(self, "state_groups", tuple(g for g in self.groups if g.holds_state))

    @property
    def state_bytes(self) -> int:
        """The bytes of one rank's state object: every Mamba-type layer's state; 0 without
        such groups, and where ranks differ (pipeline stages)."""
        if self.pp_size != 1:
            return 0
        return sum(len(g.layer_names) * g.state_page_bytes for g in self.state_groups)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def ranks(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def chunk_bytes(self) -> int:
        """The bytes of one rank's value of a chunk (`pages`: every layer's pages of its
        blocks); 0 where ranks differ (pipeline stages may hold different layer counts)."""
        if self.pp_size != 1:
            return 0
        return sum(len(g.layer_names) * g.page_bytes for g in self.kv_groups) * self.blocks_per_chunk

    def rank_index(self, tp_rank: int, pp_rank: int) -> int:
        assert 0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size
        return pp_rank * self.tp_size + tp_rank

    def keys(self, token_ids: Sequence[int], salt: str | None) -> list[list[ChunkKey]]:
        """Per rank, the chunk keys of every full chunk of ``token_ids``."""
        return [chunk_keys(digest, self.chunk_size, token_ids, salt) for digest in self.digests]

    def state_keys(self, token_ids: Sequence[int], salt: str | None) -> list[list[ChunkKey]]:
        """Per rank, the keys of the state at the end of every full chunk of ``token_ids``
        (empty lists without Mamba-type groups)."""
        return [chunk_keys(digest, self.chunk_size, token_ids, salt) for digest in self.state_digests]

    def max_hit_tokens(self, num_tokens: int) -> int:
        return max_hit_tokens(num_tokens, self.chunk_size)

    @property
    def window_tokens(self) -> int | None:
        """How far back from its end a restore reads (`restore_reach`); None: from the start."""
        return restore_reach(self.groups)

    def groups_of(self, layer_names: Sequence[str]) -> tuple[int, ...]:
        """The cache group of each layer vLLM registered; `ConnectorRefusal` for a layer in none."""
        group_of = {name: g.index for g in self.groups for name in g.layer_names}
        unknown = [name for name in layer_names if name not in group_of]
        if unknown:
            raise ConnectorRefusal(
                f"KV cache tensors registered for layer(s) in no cache group of the KV cache config: "
                f"{', '.join(unknown[:3])}"
            )
        return tuple(group_of[name] for name in layer_names)


def build_layout(vllm_config: Any, kv_cache_config: Any, config: Config) -> VllmLayout:
    """The layout of this engine; raises `ConnectorRefusal` for what cannot work."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    block_size = int(cache.block_size)
    groups = describe_groups(kv_cache_config)
    chunk_size = config.engine.chunk_size_for(block_size, smallest_window(groups))
    if chunk_size % block_size:
        raise ConnectorRefusal(
            f"engine.chunk_size {chunk_size} must be a multiple of vLLM's block size {block_size}: "
            f"set engine.chunk_size to {max(1, chunk_size // block_size) * block_size} "
            f"or --block-size to a divisor of {chunk_size}"
        )
    check_groups(groups, vllm_config, int(kv_cache_config.num_blocks), chunk_size, block_size)
    tp_size = int(parallel.tensor_parallel_size)
    pp_size = int(parallel.pipeline_parallel_size)
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    extra = (
        ("block_size", str(block_size)),
        ("device", device),
        ("dtype", str(model.dtype)),
        ("kv_cache_layout", str(getattr(kv_cache_config, "kv_cache_layout", None))),
        # A pipeline rank holds only its stage's layers: pp=2 rank 0 is not pp=1 rank 0.
        ("pp_size", str(pp_size)),
        ("tokenizer", str(getattr(model, "tokenizer", ""))),
    )
    fingerprints = tuple(
        LayoutFingerprint(
            model_id=str(model.model),
            model_revision=str(model.revision or ""),
            kv_dtype=str(cache.cache_dtype),
            kv_shapes=tuple(g.descriptor for g in groups),
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            chunk_size=chunk_size,
            key_namespace=config.engine.key_namespace,
            extra=extra,
        )
        for pp_rank in range(pp_size)
        for tp_rank in range(tp_size)
    )
    # A state object holds other bytes under the same tokens: its own fingerprint, so its
    # keys are never a chunk object's.
    states = (
        tuple(replace(f, extra=(*f.extra, ("object", "state"))) for f in fingerprints)
        if any(g.holds_state for g in groups)
        else ()
    )
    return VllmLayout(
        chunk_size=chunk_size,
        block_size=block_size,
        tp_size=tp_size,
        pp_size=pp_size,
        fingerprints=fingerprints,
        digests=tuple(f.digest() for f in fingerprints),
        groups=tuple(groups),
        state_digests=tuple(f.digest() for f in states),
    )
