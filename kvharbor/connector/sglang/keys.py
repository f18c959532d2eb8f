"""SGLang's page hashes as kvharbor keys, inside a layout fixed by the host pool.

`HiCacheStorageConfig` carries the ranks, ``is_mla_model`` and the model name but
not the page size, KV dtype or shapes: those come with the host pool
(``register_mem_pool_host``), so `build_layout` runs then, once. For MLA models
one copy serves all tensor-parallel ranks: their fingerprint names rank 0 of 1.

Hits survive SGLang restarts (the hashes are SHA-256 of the token ids, stable
across processes); they do not survive an SGLang release that changes how it
hashes pages: token ids never reach a storage backend, so kvharbor's own
prefix-chained token keys (`kvharbor.cache.keys.chunk_keys`) cannot be used here.
Such a release only misses: its hashes name no stored page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvharbor import __version__
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint, engine_page_key
from kvharbor.config import Config

PAGE_HASH_HEX = 64
"""SGLang's page hashes: SHA-256, as 64 hex characters."""

_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


class BackendRefusal(Exception):
    """A setting or host pool kvharbor cannot serve; the message names what to change."""


def page_hash_bytes(page_hash: str) -> bytes:
    """The raw bytes of one SGLang page hash.

    64 hex characters are the 32 bytes they spell; any other string (a key SGLang
    suffixes for a side pool, a future scheme) is hashed as its UTF-8 bytes, tagged
    so that it can never equal a hex hash's bytes.
    """
    if not isinstance(page_hash, str) or not page_hash:
        raise ValueError(f"an SGLang page key must be a non-empty string, got {page_hash!r}")
    if len(page_hash) == PAGE_HASH_HEX and _HEX_DIGITS.issuperset(page_hash):
        return b"\x00" + bytes.fromhex(page_hash)
    return b"\x01" + page_hash.encode("utf-8")


@dataclass(frozen=True, slots=True)
class SglangLayout:
    fingerprint: LayoutFingerprint
    page_size: int
    """Tokens per SGLang page, and so per stored object."""
    page_bytes: int
    """Bytes of one stored page."""
    digest: bytes

    def keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """kvharbor's key of each page; raises ValueError naming a malformed hash."""
        return [engine_page_key(self.digest, page_hash_bytes(h)) for h in page_hashes]


def build_layout(storage_config: Any, pool: Any, page_bytes: int, config: Config) -> SglangLayout:
    """The layout of ``pool``'s pages for this rank (``storage_config``: SGLang's
    `HiCacheStorageConfig`); raises `BackendRefusal` naming the flag or key to change."""
    page_size = int(pool.page_size)
    engine = config.engine
    if engine.chunk_size_set and engine.chunk_size != page_size:
        raise BackendRefusal(
            f"engine.chunk_size is {engine.chunk_size} tokens but SGLang's --page-size is {page_size}: "
            "kvharbor stores one object per SGLang page; leave engine.chunk_size unset or make it "
            "equal to --page-size"
        )
    if getattr(storage_config, "should_split_heads", False):
        raise BackendRefusal(
            "tp_lcm_size in --hicache-storage-backend-extra-config splits heads across ranks of "
            "different tensor-parallel sizes; kvharbor stores each rank's pages whole: remove tp_lcm_size"
        )
    replicated = bool(storage_config.is_mla_model)
    tp_size, tp_rank = (1, 0) if replicated else (int(storage_config.tp_size), int(storage_config.tp_rank))
    shape = ":".join(
        f"{name}={getattr(pool, name)}"
        for name in ("layer_num", "head_num", "head_dim", "v_head_dim")
        if getattr(pool, name, None) is not None
    )
    fingerprint = LayoutFingerprint(
        model_id=str(storage_config.model_name or ""),
        chunk_size=page_size,
        kv_dtype=str(pool.dtype),
        kv_shapes=(f"{type(pool).__name__}:{shape}:page_bytes={page_bytes}",),
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_rank=int(storage_config.pp_rank),
        key_namespace=engine.key_namespace,
        extra=(
            ("engine", "sglang"),
            ("host_layout", str(pool.layout)),
            ("pp_size", str(storage_config.pp_size)),
            ("attn_cp", f"{storage_config.attn_cp_rank}/{storage_config.attn_cp_size}"),
            ("dcp", f"{getattr(storage_config, 'dcp_rank', 0)}/{getattr(storage_config, 'dcp_size', 1)}"),
            ("rank_replicated", str(replicated)),
        ),
    )
    return SglangLayout(fingerprint, page_size, page_bytes, fingerprint.digest())


def client_name(storage_config: Any) -> str:
    """How this rank names itself to the gateway (its status and logs)."""
    return (
        f"sglang tp {storage_config.tp_rank}/{storage_config.tp_size} pp {storage_config.pp_rank} "
        f"kvharbor {__version__}"
    )
