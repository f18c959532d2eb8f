"""SGLang's zero-copy page calls through a real gateway, against memcpy of the same bytes.

Run with the SGLang venv (scripts/setup-sglang.sh): ``.venv-sglang/bin/python bench/hicache.py``.
kvharbor's backend (`KVHarborStorage`) on SGLang's real CPU host KV pool, a ``kvharbor
gateway`` subprocess with a RAM tier; in one run, best of ``--repeats``:

- **set**: ``batch_set_v1`` of ``--pages`` new pages (SGLang's largest batch: 128);
- **get**: ``batch_get_v1`` of those pages into other host slots;
- **memcpy**: one copy of the same number of bytes between two host buffers.

Ratios are memcpy's time over the call's (1.0x: as fast as one memcpy; target >= 0.5x).
Each of ``--shapes`` is measured, a model's KV shape (layers, KV heads, head dim, bf16):
``test``, the tests' tiny model (2 KiB a token: a 64-token page is 128 KiB), where the
gateway's work per page (two round trips a call, an index entry per page) weighs against a
copy of 10 microseconds; ``llama-3.2-1b`` (16 layers, 8 KV heads of 64: a 64-token page is
2 MiB, the page of a small production model), where the copies do. Their figures are
prefixed with the shape's name.

Then (unless ``--no-engine``) the engine test's restart, timed: a real SGLang engine process
on the CPU (`tests/sglang/engine_rig`, the tiny Llama, ``KVHARBOR=1``) answers a prompt of
``--engine-tokens`` cold; a second process, with a new gateway, answers it again from
kvharbor's file tier. ``restart_vs_cold`` is the restarted answer's time over the cold one's
(each the first answer of a fresh process; lower is better). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from common import best_seconds, emit  # noqa: E402
from ipc import gateway  # noqa: E402

from tests.sglang.shims.install import install  # noqa: E402

install()  # SGLang imports torchvision, whose PyPI build does not import on a CPU torch.

import torch  # noqa: E402

from kvharbor.demo.model import build_tiny_model  # noqa: E402
from tests.sglang.engine_rig import bound_tokens, run_engine, write_config  # noqa: E402
from tests.sglang.sglang_rig import HEAD_DIM, HEADS, LAYERS, backend, host_pool  # noqa: E402

SHAPES = {"test": (LAYERS, HEADS, HEAD_DIM), "llama-3.2-1b": (16, 8, 64)}
"""KV shapes measured: (layers, KV heads, head dim)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-engine", action="store_true", help="leave the engine restart out")
    parser.add_argument("--engine-tokens", type=int, default=3000, help="the engine prompt's tokens")
    parser.add_argument(
        "--copy-threads", type=int, default=None, help="sglang.copy_threads of the page calls (default: the config's)"
    )
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for name in shapes:
        shape_figures, shape_ratios = page_calls(
            SHAPES[name], args.pages, args.page_size, args.repeats, args.copy_threads
        )
        figures.update({f"{name}_{key}": value for key, value in shape_figures.items()})
        ratios.update({f"{name}_{key}": value for key, value in shape_ratios.items()})
    if not args.no_engine:
        restart_figures, restart_ratios = engine_restart(args.engine_tokens)
        figures.update(restart_figures)
        ratios.update(restart_ratios)
    emit(figures, ratios, args.json)


def page_calls(
    shape: tuple[int, int, int], pages: int, page_size: int, repeats: int, copy_threads: int | None
) -> tuple[dict[str, Any], dict[str, float]]:
    """The set, get and memcpy of ``pages`` pages of a model of ``shape``, through a fresh gateway."""
    tokens = pages * page_size
    with tempfile.TemporaryDirectory(prefix="kvh-bench-sglang-") as tmp, gateway(Path(tmp), 512, 4, 64) as _:
        (config,) = Path(tmp).glob("bench-*.yaml")  # The gateway's own config: the same storage.
        pool = host_pool(page_size, device_tokens=tokens, shape=shape)
        extra: dict[str, Any] = {"backend_name": "kvharbor", "interface_v1": 1, "config_file": str(config)}
        if copy_threads is not None:
            extra["sglang"] = {"copy_threads": copy_threads}
        storage = backend(extra, pool)
        assert storage.is_on, storage.off_reason
        source = torch.arange(tokens, dtype=torch.int64)
        target = torch.arange(tokens, 2 * tokens, dtype=torch.int64)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
        page_bytes = storage._layout.page_bytes if storage._layout else 0
        nbytes = page_bytes * pages

        def fresh_keys() -> list[str]:
            return [uuid.uuid4().hex * 2 for _ in range(pages)]  # 64 hex, like SGLang's.

        stored = fresh_keys()

        def put() -> None:
            assert all(storage.batch_set_v1(fresh_keys(), source))

        def get() -> None:
            assert all(storage.batch_get_v1(stored, target))

        assert all(storage.batch_set_v1(stored, source))
        src = bytearray(nbytes)
        dst = bytearray(nbytes)

        def memcpy() -> None:
            memoryview(dst)[:] = src

        # One call per timing (min_s 0): a set stores new pages each time, so looping it to a
        # minimum time would time a RAM tier that fills and evicts.
        times = {"memcpy": best_seconds(memcpy, repeats, min_s=0), "set": best_seconds(put, repeats, min_s=0)}
        times["get"] = best_seconds(get, repeats, min_s=0)
        storage.close()
    gib = nbytes / (1 << 30)
    figures = {
        "pages": pages,
        "copy_threads": storage._fanout.threads if storage._fanout else 0,
        "page_bytes": page_bytes,
        "batch_mib": nbytes / (1 << 20),
        "memcpy_gib_per_s": gib / times["memcpy"],
        "batch_set_v1_gib_per_s": gib / times["set"],
        "batch_get_v1_gib_per_s": gib / times["get"],
        "batch_set_v1_ms": times["set"] * 1000,
        "batch_get_v1_ms": times["get"] * 1000,
    }
    ratios = {
        "batch_set_v1_vs_memcpy": times["memcpy"] / times["set"],
        "batch_get_v1_vs_memcpy": times["memcpy"] / times["get"],
    }
    return figures, ratios


def engine_restart(prompt_tokens: int) -> tuple[dict[str, Any], dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="kvh-bench-sglang-engine-") as tmp:
        directory = Path(tmp)
        model = build_tiny_model(directory / "model")
        config = write_config(directory)
        cold, _ = run_engine(model, config, 2, directory / "engine-1.log", prompt_tokens)
        (restarted,) = run_engine(model, config, 1, directory / "engine-2.log", prompt_tokens)
    figures = {
        "engine_prompt_tokens": prompt_tokens,
        "engine_bound_tokens": bound_tokens(prompt_tokens),
        "engine_restart_storage_tokens": restarted.storage_tokens,
        "engine_cold_s": cold.seconds,
        "engine_restart_s": restarted.seconds,
        "engine_same_output": restarted.output_ids == cold.output_ids,
    }
    return figures, {"restart_vs_cold": restarted.seconds / cold.seconds}


if __name__ == "__main__":
    main()
