"""A real connector layout without vLLM, and the one value every chunk of it holds.

`synthetic_layout` builds the `VllmLayout` through `build_layout` itself, from
stand-ins of the few vLLM config fields it reads (model, dtype, block size,
parallel sizes, one full-attention KV cache group): the fingerprints, keys and
chunk sizes are those a vLLM engine of that shape computes. `chunk_value` is the
synthetic KV of a chunk: a pure function of the rank and the key, so any byte
that comes back under another key, or damaged, is caught by comparing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvharbor.config import Config
from kvharbor.connector.vllm.layout import VllmLayout, build_layout
from kvharbor.scenario.schema import EngineSetup

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class FullAttentionSpec:
    """What `describe_groups` reads of vLLM's spec of the same name (its class name is the kind)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _DTYPE_BYTES.get(self.dtype, 2)


@dataclass(frozen=True)
class _Group:
    kv_cache_spec: FullAttentionSpec
    layer_names: list[str] = field(default_factory=list)


def synthetic_layout(setup: EngineSetup, config: Config) -> VllmLayout:
    spec = FullAttentionSpec(setup.block_size, setup.kv_heads, setup.head_size, setup.kv_dtype)
    group = _Group(spec, [f"model.layers.{i}.self_attn" for i in range(setup.layers)])
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=setup.block_size, cache_dtype=setup.kv_dtype),
        model_config=SimpleNamespace(
            model=setup.model, revision=setup.model_revision, dtype=setup.kv_dtype, tokenizer=setup.model
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=setup.tp_size, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        scheduler_config=SimpleNamespace(watermark=0.0),
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group], num_blocks=1 << 16, kv_cache_layout="NHD")
    return build_layout(vllm_config, kv_cache_config, config)


def chunk_value(rank: int, key: bytes, size: int) -> bytes:
    """The bytes rank ``rank`` stores under ``key``: the same for every writer, different per key."""
    return random.Random(bytes([rank]) + bytes(key)).randbytes(size)
