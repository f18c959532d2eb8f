"""Stand-ins for vLLM's engine config: the attributes kvharbor reads, and nothing else.

The KV cache specs are vLLM's own classes; the configs around them are plain
namespaces, so a test can change one field at a time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from kvharbor.config import load_config
from kvharbor.connector.vllm.layout import VllmLayout, build_layout

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def engine(**changes: Any) -> tuple[SimpleNamespace, SimpleNamespace]:
    """(vllm_config, kv_cache_config) stand-ins with the attributes the layout reads."""
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="/models/tiny", revision=None, dtype=torch.float32, tokenizer="/models/tiny"
        ),
        cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        scheduler_config=SimpleNamespace(watermark=0.01),
    )
    spec: dict[str, Any] = {"block_size": 128, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    spec.update(changes.pop("spec", {}))
    kv_cache_config = SimpleNamespace(
        num_blocks=2048,
        kv_cache_layout="LBHNC",
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(**spec))],
    )
    for path, value in changes.items():
        target: Any = vllm_config if not path.startswith("kv.") else kv_cache_config
        parts = path.removeprefix("kv.").split(".")
        for part in parts[:-1]:
            target = getattr(target, part)
        setattr(target, parts[-1], value)
    return vllm_config, kv_cache_config


def layout(chunk_size: int = 256, **changes: Any) -> VllmLayout:
    config = load_config(environ={}, overrides={"engine": {"chunk_size": chunk_size}})
    return build_layout(*engine(**changes), config)
