"""SGLang's own host KV pool and HiCache controller page paths, built on the CPU for tests.

`host_pool` is SGLang's `MHATokenToKVPoolHost` mirroring a real CPU `MHATokenToKVPool`
(the construction SGLang's own storage unit test uses in 0.5.23). `PagePaths` is SGLang's
`HiCacheController` with only what its page paths read: ``attach_storage_backend`` needs
SGLang's distributed state (``get_parallel()``, gloo groups) that no engine set up here; the
page functions are chosen as it chooses them for a ``dynamic`` backend with ``interface_v1``.
Everything the tests call on it (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``,
``_generic_page_get``) is SGLang's code, unchanged.
"""

from __future__ import annotations

import threading
from queue import Queue
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_hash_str

from kvharbor.connector.sglang.backend import KVHarborStorage

LAYERS = 4
HEADS = 2
HEAD_DIM = 64
DEVICE_TOKENS = 512


def host_pool(
    page_size: int = 16,
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
    device_tokens: int = DEVICE_TOKENS,
    shape: tuple[int, int, int] = (LAYERS, HEADS, HEAD_DIM),
) -> Any:
    """A host pool twice the size of a device pool of ``device_tokens``, for a model of
    ``shape`` (layers, KV heads, head dim; by default the tests' tiny one)."""
    layers, heads, head_dim = shape
    device = MHATokenToKVPool(
        device_tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, start_layer=0, end_layer=layers
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page_size,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size if device.host_capacity_tokens is None else device.host_capacity_tokens,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )


def storage_config(extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1, model: str = "tiny") -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=dict(extra),
    )


def backend(extra: dict[str, Any], pool: Any, **config: Any) -> KVHarborStorage:
    """kvharbor's backend as SGLang's factory builds it: ``cls(storage_config, kwargs)``,
    then ``register_mem_pool_host``."""
    storage = KVHarborStorage(storage_config(extra, **config), {})
    storage.register_mem_pool_host(pool)
    return storage


def page_hashes(token_ids: list[int], page_size: int) -> list[str]:
    """SGLang's chained page hashes of the full pages of ``token_ids`` (what the radix tree passes)."""
    hashes: list[str] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        hashes.append(get_hash_str(token_ids[start : start + page_size], hashes[-1] if hashes else None))
    return hashes


class PagePaths:
    """SGLang's HiCacheController page paths around ``storage`` and ``pool``."""

    def __init__(self, storage: Any, pool: Any) -> None:
        controller = HiCacheController.__new__(HiCacheController)
        controller.page_size = pool.page_size
        controller.mem_pool_host = controller.storage_host_pool = pool
        controller.storage_backend = storage
        controller.storage_backend_type = "dynamic"
        controller.storage_config = storage._storage_config
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
        controller.prefetch_sync_queue = Queue()
        controller.backup_queue = Queue()
        controller.ack_backup_queue = Queue()
        controller.storage_stop_event = threading.Event()
        self.controller = controller
        self.pool = pool

    def backup(self, host_indices: torch.Tensor, token_ids: list[int]) -> int:
        """Store the pages at ``host_indices`` as SGLang's backup thread does; tokens stored."""
        operation = self.write_operation(host_indices, token_ids)
        self.controller._page_backup(operation)
        return operation.completed_tokens

    def write_operation(self, host_indices: torch.Tensor, token_ids: list[int]) -> StorageOperation:
        return StorageOperation(host_indices, token_ids, hash_value=page_hashes(token_ids, self.pool.page_size))

    def hit_tokens(self, token_ids: list[int]) -> int:
        """Tokens SGLang's storage hit query finds for a prompt."""
        _, tokens = self.controller._storage_hit_query(PrefetchOperation("query", token_ids))
        return tokens

    def prefetch(self, token_ids: list[int], host_indices: torch.Tensor) -> int:
        """Read the stored leading pages of ``token_ids`` into ``host_indices``; pages read."""
        operation = PrefetchOperation("prefetch", token_ids)
        hashes, _ = self.controller._storage_hit_query(operation)
        operation.hash_value = hashes
        operation.host_indices = host_indices
        return self.controller._page_transfer(operation)
