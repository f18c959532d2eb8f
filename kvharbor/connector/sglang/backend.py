"""`KVHarborStorage`: kvharbor as SGLang's HiCache storage backend.

Loaded by SGLang's dynamic backend factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvharbor",
        "module_path": "kvharbor.connector.sglang.backend", "class_name": "KVHarborStorage",
        "interface_v1": 1, "prefetch_threshold": 1}'

(``KVHARBOR=1`` fills these in: `activation`.) SGLang constructs it as
``cls(storage_config, kwargs)`` and then hands it the host KV pool
(``register_mem_pool_host``), which fixes the layout (`keys.build_layout`). The
extra config may also hold ``config_file`` and kvharbor config sections
(`kvharbor.connector.extra_config`).

Contract with SGLang:

- ``batch_exists`` is the length of the leading run of stored pages;
  ``batch_get_v1``/``batch_set_v1`` copy whole pages between the host pool and the
  gateway's shared memory (`pages`), and say per page whether it was done (a get:
  the leading pages found intact; a set: every page, or none).
- Nothing here raises into SGLang, and a refusal never stops it: a bad setting, a
  host pool kvharbor cannot serve, or a gateway that is missing or fails turns the
  backend off on this rank with one ``kvharbor:`` line naming the cause; every call
  then answers at once as a miss (SGLang would otherwise not start, or fail
  requests). A gateway failure follows the vLLM connector's restart rule
  (`kvharbor.connector.link`).
- Hybrid models' side pools (the v2 methods' Mamba, SWA or indexer pools) are not
  stored: their lookups miss, with one line naming the pool.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvharbor.cache.keys import ChunkKey, namespace_tag
from kvharbor.config import Config, ConfigError
from kvharbor.connector.extra_config import config_from_extra
from kvharbor.connector.fanout import Fanout
from kvharbor.connector.link import CacheLink
from kvharbor.connector.sglang.keys import BackendRefusal, SglangLayout, build_layout, client_name
from kvharbor.connector.sglang.pages import HostPages, Span
from kvharbor.gateway import embedded
from kvharbor.hal.checksum import copy_with_checksum
from kvharbor.telemetry.log import PREFIX, OnceLog, attach_to_engine_log, get_logger

_log = get_logger("kvharbor.connector.sglang")

EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
SGLANG_KEYS = frozenset(
    {
        "backend_name", "module_path", "class_name", "interface_v1",
        # SGLang's own, which it takes out of the config before the backend sees it (0.5.23).
        "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys", "tp_lcm_size",
    }
)  # fmt: skip
"""Keys of the extra config that SGLang itself reads."""


class KVHarborStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        attach_to_engine_log()
        self._storage_config = storage_config
        self._once = OnceLog(_log)
        self._refusal = ""
        self._config: Config | None = None
        self._layout: SglangLayout | None = None
        self._pages: HostPages | None = None
        self._link: CacheLink | None = None
        self._fanout: Fanout | None = None
        self._namespace = 0
        try:
            self._config = config_from_extra(storage_config.extra_config, EXTRA_CONFIG_FLAG, engine_keys=SGLANG_KEYS)
        except ConfigError as err:
            self._refuse(str(err))

    # -- set-up ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._config is None:
            return
        try:
            pages = HostPages(mem_pool_host)
            layout = build_layout(self._storage_config, mem_pool_host, pages.page_bytes, self._config)
        except BackendRefusal as err:
            self._refuse(str(err))
            return
        connect = partial(embedded.connect, layouts=(layout.fingerprint,))
        name = f"{client_name(self._storage_config)} pid {os.getpid()}"
        self._layout, self._pages = layout, pages
        self._namespace = namespace_tag(self._config.engine.key_namespace)
        self._link = CacheLink(self._config, name, connect=connect)
        self._fanout = Fanout(self._config.sglang.copy_threads, "kvharbor-sglang-copy")
        if self._link.start():  # Connect now: a missing gateway is said at start, not at the first request.
            _log.info(
                "%sSGLang storage backend on: one object per page of %d tokens (%d bytes), layout %s",
                PREFIX, layout.page_size, layout.page_bytes, layout.fingerprint.short(),
            )  # fmt: skip

    @property
    def is_on(self) -> bool:
        """Whether this rank stores and reads pages (False once refused or after a gateway failure)."""
        return self._link is not None and not self._link.is_off

    @property
    def off_reason(self) -> str:
        if self._refusal:
            return self._refusal
        if self._link is None:
            return "no host pool registered yet"
        return self._link.off_reason

    @property
    def flush_ms(self) -> int:
        """``sglang.shutdown_flush_ms`` of this backend's config (see `activation`)."""
        return self._config.sglang.shutdown_flush_ms if self._config is not None else 0

    def _refuse(self, reason: str) -> None:
        self._refusal = reason
        _log.error(
            "%sthe SGLang storage backend is off on this rank: %s. SGLang keeps serving without "
            "kvharbor's storage tier",
            PREFIX,
            reason,
        )

    def _ready(self) -> tuple[SglangLayout, HostPages, CacheLink] | None:
        if self._layout is None or self._pages is None or self._link is None or self._link.is_off:
            return None
        return self._layout, self._pages, self._link

    def _keys(self, layout: SglangLayout, page_hashes: Sequence[str]) -> list[ChunkKey] | None:
        try:
            return layout.keys(page_hashes)
        except ValueError as err:
            self._once.say("bad-key", f"SGLang passed a page key kvharbor cannot use ({err}); that call is a miss")
            return None

    def _page_spans(self, pages: HostPages, host_indices: torch.Tensor) -> list[tuple[Span, ...]] | None:
        try:
            return pages.spans(host_indices)
        except ValueError as err:
            self._once.say(
                "bad-indices", f"SGLang passed host indices kvharbor cannot use ({err}); that call is a miss"
            )
            return None

    # -- lookups ---------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        ready = self._ready()
        if ready is None or not keys:
            return 0
        layout, _, link = ready
        stored = self._keys(layout, keys)
        if stored is None:
            return 0
        return link.lookup(stored, layout.page_size, layout.page_bytes).hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy pages (interface_v1) ----------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        placed = self._placed(keys, host_indices)
        if placed is None:
            return [False] * len(keys)
        layout, pages, spans = placed
        return self._store(layout, keys, lambda i, view: pages.read(spans[i], view), self._fanout)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        placed = self._placed(keys, host_indices)
        if placed is None:
            return [False] * len(keys)
        layout, pages, spans = placed
        return self._load(layout, keys, lambda i, view: pages.write(spans[i], view), self._fanout)

    def _placed(
        self, keys: list[str], host_indices: torch.Tensor
    ) -> tuple[SglangLayout, HostPages, list[tuple[Span, ...]]] | None:
        """The layout, the host pool and each key's page spans of a v1 call; None when the
        cache is off, there is nothing to move, or the indices do not name one page per key."""
        ready = self._ready()
        if ready is None or not keys:
            return None
        layout, pages, _ = ready
        spans = self._page_spans(pages, host_indices)
        if spans is None or len(spans) != len(keys):
            return None
        return layout, pages, spans

    # -- legacy pages (flat page tensors) ----------------------------------------

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        ready = self._ready()
        if ready is None or not keys or values is None or len(values) != len(keys):
            return False
        layout, pages, _ = ready
        try:
            sources = [pages.tensor_bytes(value) for value in values]
        except ValueError as err:
            self._once.say("bad-value", f"SGLang passed a page kvharbor cannot store ({err}); not stored")
            return False

        def fill(i: int, view: memoryview) -> int:
            return copy_with_checksum(sources[i], view)

        return all(self._store(layout, keys, fill))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        ready = self._ready()
        if ready is None or not keys:
            return [None] * len(keys)
        layout, pages, _ = ready
        try:
            targets = [pages.flat_page(t) for t in (target_locations or [None] * len(keys))]
        except ValueError as err:
            self._once.say("bad-target", f"SGLang passed a page target kvharbor cannot fill ({err}); a miss")
            return [None] * len(keys)
        if len(targets) != len(keys):
            return [None] * len(keys)

        def sink(i: int, view: memoryview) -> None:
            targets[i][1][:] = view

        done = self._load(layout, keys, sink)
        return [page if ok else None for (page, _), ok in zip(targets, done, strict=True)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    # -- hybrid side pools (v2) ------------------------------------------------

    def _refuse_side_pools(self, transfers: Sequence[PoolTransfer] | None) -> bool:
        """True (said once) if ``transfers`` name a pool other than the KV pool."""
        side = sorted({str(t.name) for t in transfers or () if t.name != PoolName.KV})
        if side:
            self._once.say(
                "side-pools",
                f"kvharbor stores SGLang's KV pool only; the hybrid model's {', '.join(side)} pool(s) "
                "are not stored, so its prefixes are not read back from kvharbor",
            )
        return bool(side)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        if self._refuse_side_pools(pool_transfers):
            return PoolTransferResult.empty()
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {PoolName.KV: hits} if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._transfer_v2(transfers, self.batch_get_v1, extra_info)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._transfer_v2(transfers, self.batch_set_v1, extra_info)

    def _transfer_v2(
        self, transfers: list[PoolTransfer], move: Any, extra_info: HiCacheStorageExtraInfo | None
    ) -> dict[str, list[bool]]:
        self._refuse_side_pools(transfers)
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if transfer.name == PoolName.KV and transfer.host_indices is not None:
                results[transfer.name] = move(keys, transfer.host_indices, extra_info)
            else:
                results[transfer.name] = [False] * len(keys)
        return results

    # -- the rest of the interface ---------------------------------------------

    def get_stats(self) -> dict[str, int] | None:
        return self._link.counters.snapshot() if self._link is not None else None

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        if self._fanout is not None:
            self._fanout.close()

    # -- internals -------------------------------------------------------------

    def _store(
        self, layout: SglangLayout, page_hashes: Sequence[str], fill: Any, fanout: Fanout | None = None
    ) -> list[bool]:
        """Store one page per hash (``fill(i, view)`` writes page i, on ``fanout``'s threads
        if given); all True when the gateway took the batch (pages already stored are
        skipped, not rewritten)."""
        link = self._link
        stored = self._keys(layout, page_hashes)
        if link is None or stored is None:
            return [False] * len(page_hashes)
        refused = link.counters.refused
        items = [(key, layout.page_bytes) for key in stored]
        link.store(layout.digest, items, fill, namespace=self._namespace, fanout=fanout)
        ok = not link.is_off and link.counters.refused == refused
        return [ok] * len(page_hashes)

    def _load(
        self, layout: SglangLayout, page_hashes: Sequence[str], sink: Any, fanout: Fanout | None = None
    ) -> list[bool]:
        """Hand the leading stored pages to ``sink(i, view)`` (on ``fanout``'s threads where
        given); True for each page of the leading run handed over whole. A value of another
        size is never copied and ends the run (a page after it may have been copied into its
        own target, which is then reported not loaded)."""
        link = self._link
        stored = self._keys(layout, page_hashes)
        if link is None or stored is None:
            return [False] * len(page_hashes)
        copied = [False] * len(page_hashes)

        def checked(i: int, view: memoryview) -> None:
            if view.nbytes == layout.page_bytes:
                sink(i, view)
                copied[i] = True  # Page i's own slot: no other sink touches it.

        link.load(layout.digest, stored, checked, fanout)
        intact = copied.index(False) if False in copied else len(copied)
        return [i < intact for i in range(len(page_hashes))]
