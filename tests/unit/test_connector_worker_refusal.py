"""A refusal only the worker can make (the tensors vLLM registers): the activation decides.

The connector is built in its worker role from a real vLLM engine config (the tiny
model's), as vLLM builds it; only the distributed state it asks for its ranks is
answered without a process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import kvharbor.connector.vllm.connector as connector_module
from kvharbor.connector.ranks import SoleRank
from kvharbor.connector.vllm.connector import KVHarborConnector
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.plugin import ACTIVATED_BY_ENV, ACTIVATION_KEY

BLOCKS = 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def worker(model: Path, tmp_path: Path, marked: bool) -> KVHarborConnector:
    extra: dict[str, Any] = {"gateway": {"socket": str(tmp_path / "gw.sock")}}
    if marked:
        extra[ACTIVATION_KEY] = ACTIVATED_BY_ENV
    transfer = KVTransferConfig(
        kv_connector="KVHarborConnector",
        kv_connector_module_path="kvharbor.connector.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    args = EngineArgs(
        model=str(model), enforce_eager=True, dtype="float32", max_model_len=2048, kv_transfer_config=transfer
    )
    vllm_config = args.create_engine_config()
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    with (
        mock.patch.object(connector_module, "_worker_ranks", lambda: (0, 0)),
        mock.patch.object(connector_module, "_tensor_parallel_group", SoleRank),
    ):
        return KVHarborConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def two_dtypes() -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, but the last layer in half precision: pages the connector cannot copy as one."""
    kv = {name: torch.zeros(BLOCKS, 2, 128, 128) for name in LAYERS}
    kv[LAYERS[-1]] = kv[LAYERS[-1]].to(torch.float16)
    return kv


def test_under_kvharbor_1_alone_the_engine_runs_on_without_the_cache(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    connector = worker(tiny_model, tmp_path, marked=True)
    connector.register_kv_caches(two_dtypes())  # No exception: vLLM starts.
    said = [r.getMessage() for r in caplog.records if "cannot serve this model" in r.getMessage()]
    assert len(said) == 1 and "differ in page shape or dtype" in said[0]
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["cache_off"] == 1
    load = ChunkTransfer(request_id="r", keys=[[bytes(16)]], block_ids=[[1, 2]], skip_blocks=0)
    meta = KVHarborMetadata(loads=[load])
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(mock.Mock())
    assert connector.get_block_ids_with_load_errors() == {1, 2}  # Recomputed, never read.
    connector.shutdown()
    assert not (tmp_path / "gw.sock").exists()  # No gateway was started for it.


def test_named_in_the_transfer_config_the_connector_refuses_to_start(tiny_model: Path, tmp_path: Path) -> None:
    connector = worker(tiny_model, tmp_path, marked=False)
    with pytest.raises(RuntimeError, match="the connector refuses to start: KV cache tensors differ"):
        connector.register_kv_caches(two_dtypes())
    connector.shutdown()
