"""What the ``kvharbor status`` and ``doctor`` tests share: the CLI as a subprocess, a
gateway with a RAM and a file tier, and an engine stand-in that registers a layout and
stores a prompt's chunks under it through the real client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway_harness import Lab

from kvharbor.cache.keys import LayoutFingerprint, chunk_keys
from kvharbor.gateway.client import GatewayClient

CHUNK = 256
"""engine.chunk_size of the default config."""
LAYOUT = LayoutFingerprint(
    model_id="tiny-llama",
    chunk_size=CHUNK,
    kv_shapes=("FullAttentionSpec[2](bs=16,page=4096,num_kv_heads=2,head_size=16,dtype=torch.float32)",),
    extra=(("block_size", "16"), ("device", "cpu")),
)
"""A layout as `kvharbor.connector.vllm.layout.build_layout` makes one for the tiny model."""
VALUE_BYTES = 4096


def kvharbor_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvharbor ARGS`` without KVHARBOR* settings from the environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVHARBOR")}
    return subprocess.run(
        [sys.executable, "-m", "kvharbor", *args], env=clean, capture_output=True, text=True, timeout=120
    )


def two_tier_config(lab: Lab, name: str = "gw", **gateway: Any) -> Path:
    return lab.config(
        name,
        tiers=[
            {"name": "ram", "type": "ram", "capacity_gb": 0.05},
            {
                "name": "files",
                "type": "file",
                "path": str(lab.tmp_path / name / "files"),
                "capacity_gb": 0.05,
                # Its health then does not follow how full the host's disk is (a CI host ran below 5% free).
                "degraded_below_free_pct": 0,
            },
        ],
        **gateway,
    )


def store_prompt(
    client: GatewayClient, tokens: Sequence[int], layout: LayoutFingerprint = LAYOUT, salt: str | None = None
) -> int:
    """Store every full chunk of ``tokens`` under ``layout`` as an engine would; returns how many."""
    keys = chunk_keys(layout.digest(), layout.chunk_size, tokens, salt)
    batch = client.prepare_put(layout.digest(), [(key, VALUE_BYTES) for key in keys])
    for view in batch.views:
        assert view is not None
        view[:] = bytes(VALUE_BYTES)
    return client.commit_put(batch)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every file under ``root``: to show that a tool changed nothing."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}
