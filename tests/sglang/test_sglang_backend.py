"""kvharbor as SGLang's HiCache storage backend, driven through SGLang's own page paths.

A real in-process gateway (`real_gateway`), SGLang's real CPU host KV pool and SGLang's
HiCacheController page functions (tests/sglang/sglang_rig.py): pages written by the
backup path are found by the storage hit query, read back byte for byte by the prefetch
path, follow prefix semantics, and miss under another layout; bad input turns the backend
off with a line naming what to change, and every call still answers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharbor.connector.sglang.activation import backend_extra_config
from kvharbor.connector.sglang.shutdown import flush_if_kvharbor
from tests.sglang.sglang_rig import PagePaths, backend, host_pool, page_hashes
from tests.support.real_gateway import RealGateway

PAGE = 16
PAGES = 6


def extra(gateway: RealGateway, **more: Any) -> dict[str, Any]:
    """The extra config ``KVHARBOR=1`` builds, pointed at the test's gateway."""
    return {**backend_extra_config(), "config_file": str(gateway.config_path), **more}


def fill_random(pool: Any, pages: int, seed: int) -> torch.Tensor:
    """Random bytes in the pool's first ``pages`` pages; their host indices."""
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(pool.kv_buffer.dtype))
    return torch.arange(pages * pool.page_size, dtype=torch.int64)


def page_bytes(pool: Any, index: int) -> bytes:
    return pool.get_data_page(index).contiguous().view(torch.uint8).numpy().tobytes()


def kvharbor_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvharbor:")]


@pytest.mark.parametrize("copy_threads", [1, 3], ids=["in-turn", "three-threads"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_backup_then_prefetch_reads_every_page_back_byte_identical(
    real_gateway: RealGateway, layout: str, copy_threads: int
) -> None:
    pool = host_pool(PAGE, layout)
    storage = backend(extra(real_gateway, sglang={"copy_threads": copy_threads}), pool)
    assert storage._fanout is not None and storage._fanout.threads == copy_threads
    paths = PagePaths(storage, pool)
    written = fill_random(pool, PAGES, seed=1)
    tokens = list(range(1000, 1000 + PAGES * PAGE + 5))  # A partial tail: never a page.
    originals = [page_bytes(pool, i * PAGE) for i in range(PAGES)]

    assert paths.hit_tokens(tokens) == 0
    assert paths.backup(written, tokens) == PAGES * PAGE
    assert real_gateway.puts == PAGES
    assert paths.hit_tokens(tokens) == PAGES * PAGE

    # Other host slots, holding other random bytes until the prefetch.
    target = torch.arange(PAGES * PAGE, 2 * PAGES * PAGE, dtype=torch.int64)
    assert [page_bytes(pool, PAGES * PAGE + i * PAGE) for i in range(PAGES)] != originals
    assert paths.prefetch(tokens, target) == PAGES
    assert [page_bytes(pool, PAGES * PAGE + i * PAGE) for i in range(PAGES)] == originals
    # The legacy interface reads the same bytes: one stored format for both.
    flat = storage.get(page_hashes(tokens, PAGE)[2])
    assert flat is not None and flat.view(torch.uint8).numpy().tobytes() == originals[2]


def test_prefix_semantics_leading_run_only(real_gateway: RealGateway) -> None:
    pool = host_pool(PAGE)
    storage = backend(extra(real_gateway), pool)
    paths = PagePaths(storage, pool)
    written = fill_random(pool, 4, seed=2)
    tokens = list(range(4 * PAGE))
    paths.backup(written, tokens)

    assert paths.hit_tokens(tokens + list(range(7000, 7000 + 2 * PAGE))) == 4 * PAGE  # A longer prompt.
    changed = tokens.copy()
    changed[PAGE + 3] = 99_999  # Page 1 differs: pages 1.. name other prefixes.
    assert paths.hit_tokens(changed) == PAGE
    hashes = page_hashes(tokens, PAGE)
    assert storage.batch_exists([hashes[0], page_hashes(changed, PAGE)[1], hashes[2]]) == 1
    assert storage.batch_exists(hashes[1:]) == 3


@pytest.mark.parametrize(
    ("other", "config"),
    [
        (dict(layout="layer_first"), {}),
        (dict(page_size=2 * PAGE), {}),
        (dict(dtype=torch.float16), {}),
        ({}, dict(tp_rank=1, tp_size=2)),
        ({}, dict(model="another-model")),
    ],
    ids=["layout", "page-size", "kv-dtype", "tp-rank", "model"],
)
def test_another_layout_never_hits(real_gateway: RealGateway, other: dict[str, Any], config: dict[str, Any]) -> None:
    pool = host_pool(PAGE)
    paths = PagePaths(backend(extra(real_gateway), pool), pool)
    tokens = list(range(4 * 2 * PAGE))
    paths.backup(fill_random(pool, 8, seed=3), tokens)
    assert paths.hit_tokens(tokens) == len(tokens)

    other_pool = host_pool(**{"page_size": PAGE, **other})
    other_paths = PagePaths(backend(extra(real_gateway), other_pool, **config), other_pool)
    assert other_paths.hit_tokens(tokens) == 0
    assert other_paths.prefetch(tokens, torch.arange(len(tokens), dtype=torch.int64)) == 0


def assert_off_and_serving(storage: Any, pool: Any) -> None:
    """Every call of SGLang's answers at once, as a miss, and raises nothing."""
    paths = PagePaths(storage, pool)
    tokens = list(range(2 * PAGE))
    indices = torch.arange(2 * PAGE, dtype=torch.int64)
    assert not storage.is_on
    assert paths.backup(indices, tokens) == 0
    assert paths.hit_tokens(tokens) == 0
    assert storage.batch_get_v1(page_hashes(tokens, PAGE), indices) == [False, False]
    assert storage.get(page_hashes(tokens, PAGE)[0]) is None


def test_unknown_extra_config_key_is_named_and_sglang_keeps_serving(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    pool = host_pool(PAGE)
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        storage = backend(extra(real_gateway, chunk_sise=16), pool)
    (line,) = kvharbor_lines(caplog)
    assert "--hicache-storage-backend-extra-config: unknown key(s) chunk_sise" in line
    assert "SGLang keeps serving" in line
    assert_off_and_serving(storage, pool)


def test_chunk_size_other_than_page_size_is_refused_naming_both(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    pool = host_pool(PAGE)
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        storage = backend(extra(real_gateway, engine={"chunk_size": 256}), pool)
    (line,) = kvharbor_lines(caplog)
    assert "engine.chunk_size is 256 tokens but SGLang's --page-size is 16" in line
    assert_off_and_serving(storage, pool)
    # The page size itself is fine:
    assert backend(extra(real_gateway, engine={"chunk_size": PAGE}), pool).is_on


def test_unknown_host_pool_layout_is_named(real_gateway: RealGateway, caplog: pytest.LogCaptureFixture) -> None:
    pool = host_pool(PAGE, "page_unified")
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        storage = backend(extra(real_gateway), pool)
    (line,) = kvharbor_lines(caplog)
    assert "--hicache-mem-layout 'page_unified' is a host-pool layout kvharbor does not know" in line
    assert_off_and_serving(storage, pool)


def test_missing_gateway_turns_the_cache_off_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "kvharbor.yaml"
    config.write_text(f"gateway: {{mode: service, socket: {tmp_path / 'none.sock'}}}\n")
    pool = host_pool(PAGE)
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        storage = backend({**backend_extra_config(), "config_file": str(config)}, pool)
        assert_off_and_serving(storage, pool)
    (line,) = kvharbor_lines(caplog)
    assert "external KV cache turned off on this rank: no gateway answers at" in line
    assert "none.sock" in line


def test_gateway_gone_mid_run_turns_off_and_sglang_keeps_serving(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    pool = host_pool(PAGE)
    storage = backend(extra(real_gateway), pool)
    paths = PagePaths(storage, pool)
    tokens = list(range(2 * PAGE))
    paths.backup(fill_random(pool, 2, seed=4), tokens)
    assert paths.hit_tokens(tokens) == 2 * PAGE
    real_gateway.stop()
    with caplog.at_level(logging.ERROR, logger="kvharbor"):
        assert paths.hit_tokens(tokens) == 0
        assert_off_and_serving(storage, pool)
    assert len([line for line in kvharbor_lines(caplog) if "turned off on this rank" in line]) == 1


def test_hybrid_side_pools_are_refused_by_name(real_gateway: RealGateway, caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = host_pool(PAGE)
    storage = backend(extra(real_gateway), pool)
    tokens = list(range(2 * PAGE))
    PagePaths(storage, pool).backup(fill_random(pool, 2, seed=5), tokens)
    hashes = page_hashes(tokens, PAGE)
    assert storage.batch_exists_v2(hashes, []).kv_hit_pages == 2
    with caplog.at_level(logging.WARNING, logger="kvharbor"):
        mamba = PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:])
        assert storage.batch_exists_v2(hashes, [mamba]).kv_hit_pages == 0
        assert storage.batch_set_v2([mamba]) == {PoolName.MAMBA: [False]}
    (line,) = kvharbor_lines(caplog)
    assert "the hybrid model's mamba pool(s) are not stored" in line


def test_shutdown_flushes_queued_writes(real_gateway: RealGateway, caplog: pytest.LogCaptureFixture) -> None:
    pool = host_pool(PAGE)
    storage = backend(extra(real_gateway), pool)
    paths = PagePaths(storage, pool)
    indices = fill_random(pool, 4, seed=6)
    prompts = [list(range(n * 1000, n * 1000 + 2 * PAGE)) for n in (1, 2)]
    for prompt, half in zip(prompts, (indices[: 2 * PAGE], indices[2 * PAGE :]), strict=True):
        paths.controller.backup_queue.put(paths.write_operation(half, prompt))  # Queued, not yet written.
    assert [paths.hit_tokens(p) for p in prompts] == [0, 0]
    with caplog.at_level(logging.WARNING, logger="kvharbor"):
        report = flush_if_kvharbor(paths.controller)
    assert report is not None and (report.written, report.left) == (2, 0)
    assert [paths.hit_tokens(p) for p in prompts] == [2 * PAGE, 2 * PAGE]
    assert any("2 queued page write(s) stored, 0 not stored" in line for line in kvharbor_lines(caplog))


def test_shutdown_flush_stops_at_its_deadline(real_gateway: RealGateway) -> None:
    pool = host_pool(PAGE)
    storage = backend(extra(real_gateway, sglang={"shutdown_flush_ms": 0}), pool)
    paths = PagePaths(storage, pool)
    paths.controller.backup_queue.put(paths.write_operation(fill_random(pool, 2, seed=7), list(range(2 * PAGE))))
    report = flush_if_kvharbor(paths.controller)
    assert report is not None and (report.written, report.left) == (0, 1)
