"""The layout fingerprint and the refusals made at start (`kvharbor.connector.vllm.layout`)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from kvharbor.config import load_config
from kvharbor.connector.vllm.layout import ConnectorRefusal, build_layout, check_mamba_reserve
from tests.support.stand_ins import LAYERS, engine


def digests(chunk_size: int = 256, namespace: str = "default", **changes: Any) -> tuple[bytes, ...]:
    config = load_config(environ={}, overrides={"engine": {"chunk_size": chunk_size, "key_namespace": namespace}})
    return build_layout(*engine(**changes), config).digests


VARIANTS: dict[str, dict[str, Any]] = {
    "model": {"model_config.model": "/models/other"},
    "revision": {"model_config.revision": "abc123"},
    "dtype": {"model_config.dtype": torch.bfloat16},
    "kv cache dtype": {"cache_config.cache_dtype": "fp8"},
    "tokenizer": {"model_config.tokenizer": "/tokenizers/other"},
    "chunk size": {"chunk_size": 512},
    "block size": {"cache_config.block_size": 64, "spec": {"block_size": 64}},
    "tensor-parallel size": {"parallel_config.tensor_parallel_size": 2},
    "pipeline size": {"parallel_config.pipeline_parallel_size": 2},
    "namespace": {"namespace": "tenant-x"},
    "kv heads": {"spec": {"num_kv_heads": 4}},
    "head size": {"spec": {"head_size": 128}},
    "device": {"device_config.device_type": "cuda"},
    "kv cache layout": {"kv.kv_cache_layout": "NHD"},
}


def test_the_same_engine_gives_the_same_fingerprint() -> None:
    assert digests() == digests()


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_any_field_changes_the_fingerprint(field: str) -> None:
    changed = digests(**copy.deepcopy(VARIANTS[field]))
    assert changed[0] != digests()[0]


def test_every_variant_and_every_rank_has_its_own_fingerprint() -> None:
    seen = [d for variant in VARIANTS.values() for d in digests(**copy.deepcopy(variant))] + list(digests())
    assert len(seen) == len(set(seen))
    tp: dict[str, Any] = {"parallel_config.tensor_parallel_size": 2}
    tp2 = digests(**tp)
    assert len(tp2) == 2 and tp2[0] != tp2[1]  # Each rank holds other bytes.


def test_a_chunk_that_is_not_whole_blocks_is_refused_with_both_numbers() -> None:
    with pytest.raises(ConnectorRefusal) as refusal:
        digests(chunk_size=200)
    message = str(refusal.value)
    assert "engine.chunk_size 200" in message and "block size 128" in message
    assert "set engine.chunk_size to 128" in message


def test_an_unset_chunk_size_is_rounded_up_to_whole_blocks() -> None:
    """Hybrid models run with large blocks: the default 256 becomes the first multiple of them."""
    blocks_of: dict[str, Any] = {"cache_config.block_size": 512, "spec": {"block_size": 512}}
    layout = build_layout(*engine(**copy.deepcopy(blocks_of)), load_config(environ={}))
    assert (layout.chunk_size, layout.blocks_per_chunk) == (512, 1)
    assert layout.fingerprints[0].chunk_size == 512
    blocks_of = {"cache_config.block_size": 96, "spec": {"block_size": 96}}
    assert build_layout(*engine(**copy.deepcopy(blocks_of)), load_config(environ={})).chunk_size == 288
    # Whole blocks already: the default as it is.
    assert build_layout(*engine(), load_config(environ={})).chunk_size == 256


def test_a_chunk_size_that_was_set_is_kept_or_refused() -> None:
    blocks_of: dict[str, Any] = {"cache_config.block_size": 512, "spec": {"block_size": 512}}
    with pytest.raises(ConnectorRefusal, match=r"engine.chunk_size 256 must be a multiple of vLLM's block size 512"):
        digests(chunk_size=256, **copy.deepcopy(blocks_of))
    config = load_config(environ={"KVHARBOR__ENGINE__CHUNK_SIZE": "1024"})
    assert build_layout(*engine(**copy.deepcopy(blocks_of)), config).chunk_size == 1024


def test_a_cache_it_cannot_exchange_is_refused_by_name_before_any_other_advice() -> None:
    # Not in align mode either: a flag to set would not let this model start.
    vllm_config, kv_cache_config = engine(**{"scheduler_config.watermark": 0.0})
    local = ChunkedLocalAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, attention_chunk_size=512
    )
    kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.4.attn"], local))
    kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.5.mixer"], MAMBA))
    with pytest.raises(ConnectorRefusal) as refusal:
        build_layout(vllm_config, kv_cache_config, load_config(environ={}))
    message = str(refusal.value)
    assert "1 of 3 cache group(s)" in message
    assert "ChunkedLocalAttentionSpec (layer model.layers.4.attn)" in message
    assert "mamba-cache-mode" not in message and "watermark" not in message


MAMBA = MambaSpec(block_size=128, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32))
"""A Mamba-type state of 3 x 64 x 2 + 2 x 16 x 16 x 4 = 2,432 bytes per layer."""


def mamba_engine(**changes: Any) -> tuple[Any, Any]:
    """An engine with a Mamba-type group (2 layers) beside its attention group, in align mode."""
    settings = {"cache_config.mamba_cache_mode": "align", "cache_config.enable_prefix_caching": True, **changes}
    vllm_config, kv_cache_config = engine(**settings)
    kv_cache_config.kv_cache_groups.insert(0, KVCacheGroupSpec(["layers.0.mixer", "layers.2.mixer"], MAMBA))
    return vllm_config, kv_cache_config


def test_a_hybrid_model_stores_attention_chunks_and_a_state_object_of_its_own() -> None:
    layout = build_layout(*mamba_engine(), load_config(environ={}))
    assert [g.holds_state for g in layout.groups] == [True, False]
    assert layout.state_bytes == 2 * 2432
    plain = build_layout(*engine(**{"cache_config.enable_prefix_caching": True}), load_config(environ={}))
    assert layout.chunk_bytes == plain.chunk_bytes, "a chunk object holds the attention groups' pages only"
    # The state's layout is part of both fingerprints; a state's keys are never a chunk's.
    assert layout.digests != plain.digests
    assert len(set(layout.digests + layout.state_digests)) == 2
    tokens = list(range(600))
    assert layout.keys(tokens, None)[0] != layout.state_keys(tokens, None)[0]
    assert len(layout.state_keys(tokens, None)[0]) == len(layout.keys(tokens, None)[0]) == 2
    assert not plain.state_digests and plain.state_keys(tokens, None) == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"cache_config.mamba_cache_mode": "none"},
            "Mamba-type group 0 (MambaSpec, layer layers.0.mixer) with --mamba-cache-mode none: kvharbor stores a "
            "state per chunk boundary, which vLLM keeps only in align mode; start vLLM with --mamba-cache-mode align",
        ),
        (
            {"cache_config.enable_prefix_caching": False},
            "Mamba-type group 0 (MambaSpec) without prefix caching: vLLM then keeps no state at block boundaries to "
            "store; start vLLM with --enable-prefix-caching",
        ),
        ({"scheduler_config.watermark": 0.0}, "Start vLLM with --watermark=0.02 or more"),
    ],
    ids=["align-mode", "prefix-caching", "admission-reserve"],
)
def test_a_hybrid_model_vllm_keeps_no_states_for_is_refused_naming_the_flag(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConnectorRefusal) as refusal:
        build_layout(*mamba_engine(**changes), load_config(environ={}))
    assert message in str(refusal.value)


def test_a_model_of_states_only_is_refused() -> None:
    vllm_config, kv_cache_config = mamba_engine()
    kv_cache_config.kv_cache_groups = kv_cache_config.kv_cache_groups[:1]
    with pytest.raises(ConnectorRefusal, match="every KV cache group holds a Mamba-type state"):
        build_layout(vllm_config, kv_cache_config, load_config(environ={}))


def window_engine(window: int, **changes: Any) -> tuple[Any, Any]:
    """An engine whose one cache group is sliding-window (every layer attends to ``window``)."""
    vllm_config, kv_cache_config = engine(**changes)
    (group,) = kv_cache_config.kv_cache_groups
    spec = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=window)
    kv_cache_config.kv_cache_groups = [KVCacheGroupSpec(group.layer_names, spec)]
    return vllm_config, kv_cache_config


def test_a_sliding_window_model_is_served_with_chunks_that_fit_its_window() -> None:
    layout = build_layout(*window_engine(4096), load_config(environ={}))
    assert (layout.chunk_size, layout.groups[0].sliding_window) == (256, 4096)
    # Left unset, the chunk shrinks to whole blocks within a small window.
    assert build_layout(*window_engine(300), load_config(environ={})).chunk_size == 256
    assert build_layout(*window_engine(200), load_config(environ={})).chunk_size == 128
    # The window is part of the layout: another window never shares a key.
    assert build_layout(*window_engine(4096), load_config(environ={})).digests != (
        build_layout(*window_engine(8192), load_config(environ={})).digests
    )


def test_a_chunk_larger_than_the_window_is_refused_when_it_was_set() -> None:
    config = load_config(environ={}, overrides={"engine": {"chunk_size": 512}})
    with pytest.raises(ConnectorRefusal) as refusal:
        build_layout(*window_engine(300), config)
    message = str(refusal.value)
    assert "sliding-window group 0 (window 300 tokens)" in message
    assert "engine.chunk_size 512 is larger than the window" in message


def test_a_sliding_window_group_with_asynchronous_scheduling_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConnectorRefusal, match="start vLLM with --no-async-scheduling"):
        build_layout(*window_engine(4096, **{"scheduler_config.async_scheduling": True}), load_config(environ={}))


def hybrid_engine(window: int = 512, block_size: int = 128, **changes: Any) -> tuple[Any, Any]:
    """vLLM's hybrid allocator: a full-attention group and a sliding-window group of their own."""
    vllm_config, kv_cache_config = engine(**changes)
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=window
    )
    kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.4.self_attn.attn"], spec))
    return vllm_config, kv_cache_config


def test_a_sliding_window_group_beside_a_full_attention_group_is_exchanged() -> None:
    layout = build_layout(*hybrid_engine(), load_config(environ={}))
    assert [g.kind for g in layout.groups] == ["FullAttentionSpec", "SlidingWindowSpec"]
    # The full group needs every chunk from the start: a restore reads from the start.
    assert layout.window_tokens is None
    assert layout.chunk_size == 256  # within the window of 512
    # A chunk is every group's pages: the window layer is part of every stored chunk.
    assert layout.chunk_bytes == sum(len(g.layer_names) * g.page_bytes for g in layout.groups) * 2
    assert layout.groups_of(["model.layers.4.self_attn.attn", LAYERS[0]]) == (1, 0)
    one_group = build_layout(*engine(), load_config(environ={}))
    assert layout.digests != one_group.digests  # Another set of groups never shares a key.


def test_a_layer_in_no_cache_group_is_refused_naming_it() -> None:
    layout = build_layout(*hybrid_engine(), load_config(environ={}))
    with pytest.raises(ConnectorRefusal, match=re.escape("model.layers.9.self_attn.attn")):
        layout.groups_of(["model.layers.9.self_attn.attn"])


def test_groups_whose_blocks_hold_other_token_counts_are_refused_naming_them() -> None:
    with pytest.raises(ConnectorRefusal, match=r"group 1 SlidingWindowSpec 64"):
        build_layout(*hybrid_engine(block_size=64), load_config(environ={}))


def test_several_groups_with_pipeline_parallelism_are_refused_naming_the_flag() -> None:
    hybrid = hybrid_engine(**{"parallel_config.pipeline_parallel_size": 2})
    with pytest.raises(
        ConnectorRefusal, match=r"pipeline parallelism 2 with 2 KV cache groups .*--pipeline-parallel-size 1"
    ):
        build_layout(*hybrid, load_config(environ={}))
    build_layout(*engine(**{"parallel_config.pipeline_parallel_size": 2}), load_config(environ={}))  # one group: fine


def test_only_window_groups_restore_from_the_largest_window() -> None:
    vllm_config, kv_cache_config = window_engine(1024)
    spec = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=512)
    kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.4.self_attn.attn"], spec))
    layout = build_layout(vllm_config, kv_cache_config, load_config(environ={}))
    assert layout.window_tokens == 1024 and layout.chunk_size == 256


@pytest.mark.parametrize(
    ("groups", "watermark", "blocks", "advice"),
    [(3, 0.0, 150, "--watermark=0.02"), (3, 0.02, 100, "--watermark=0.03"), (5, 0.01, 50, "--watermark=0.1")],
)
def test_the_mamba_reserve_check_names_a_watermark_that_works(
    groups: int, watermark: float, blocks: int, advice: str
) -> None:
    with pytest.raises(ConnectorRefusal) as refusal:
        check_mamba_reserve(groups, watermark, blocks)
    message = str(refusal.value)
    assert advice in message
    advised = float(advice.split("=")[1])
    assert int(advised * blocks) >= groups  # The advice itself passes the check.
    check_mamba_reserve(groups, advised, blocks)


def test_enough_reserve_passes() -> None:
    check_mamba_reserve(3, 0.02, 150)  # int(0.02 x 150) = 3 >= 3
