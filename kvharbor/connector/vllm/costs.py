"""What a vLLM engine's prefill costs, and what a chunk weighs, for the load-or-recompute choice.

Read from the engine's config once, in the scheduler; `kvharbor.cache.bandwidth`
does the rest without knowing about vLLM.
"""

from __future__ import annotations

from typing import Any

from kvharbor.cache.bandwidth import LoadPlanner, PrefillCost
from kvharbor.config import EngineSection
from kvharbor.connector.vllm.layout import VllmLayout
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.connector.vllm")


def prefill_cost(vllm_config: Any) -> PrefillCost | None:
    """The model's prefill FLOPs (whole model: constant factors cancel against the measured
    rate); None when its shape cannot be read."""
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None) or model.hf_config
    try:
        hidden = int(model.get_hidden_size())
        head_size = int(model.get_head_size())
        layers = int(hf.num_hidden_layers)
        heads = int(hf.num_attention_heads)
        kv_heads = int(model.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return None
    intermediate = int(getattr(hf, "intermediate_size", 0) or 4 * hidden)
    return PrefillCost.transformer(hidden, layers, heads, kv_heads, head_size, intermediate)


def chunk_bytes_per_rank(layout: VllmLayout) -> int:
    """Bytes one rank stores per chunk: every attention layer's page of every block of it."""
    return sum(g.page_bytes * len(g.layer_names) for g in layout.kv_groups) * layout.blocks_per_chunk


def load_planner(vllm_config: Any, layout: VllmLayout, engine: EngineSection) -> LoadPlanner | None:
    """The load-or-recompute planner for this engine's model, or None where its shape is unreadable."""
    cost = prefill_cost(vllm_config)
    nbytes = chunk_bytes_per_rank(layout)
    if cost is None or nbytes <= 0:
        _log.info("kvharbor: model shape unreadable; every stored prefix is loaded (no load-or-recompute choice)")
        return None
    return LoadPlanner(
        cost,
        nbytes,
        layout.chunk_size,
        resample_s=engine.load_resample_s,
        resample_max_s=engine.load_resample_max_s,
        restore_bytes=layout.state_bytes,
    )
