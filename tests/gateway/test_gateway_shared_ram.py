"""The RAM tier lives in the gateway's segment: hits are served in place and clients cannot write them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from gateway_harness import (
    FINGERPRINT,
    GatewayProcess,
    closing_client,
    get_values,
    keys_of,
    put_values,
    value_for,
)

from kvharbor.config import MIB

HARNESS_DIR = Path(__file__).resolve().parent


def test_ram_hits_are_served_in_place_beyond_the_ring(started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=8)
    items = [(key, 3 * MIB) for key in keys_of(4, tag=11)]
    with closing_client(gateway.client("c")) as client:
        assert put_values(client, items[:2]) == 2  # Two at a time: each put passes through the ring.
        assert put_values(client, items[2:]) == 2
        ring = client.hello.ring_bytes
        batch = client.get(FINGERPRINT, [k for k, _ in items])
        try:
            # 12 MiB of hits through an 8 MiB ring: only possible in place.
            assert len(batch.views) == 4
            base = client.segment.view
            assert all(view.obj is base.obj for view in batch.views)
            status = client.status()["shm"]
            assert status["pinned"] == 4 and status["free_bytes"] == ring
        finally:
            client.release(batch)
        assert client.status()["shm"]["pinned"] == 0
        assert get_values(client, [k for k, _ in items]) == [value_for(k, n) for k, n in items]


def test_a_client_cannot_write_into_the_ram_tier(started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=8)
    key = keys_of(1, tag=12)[0]
    with closing_client(gateway.client("c")) as client:
        assert put_values(client, [(key, MIB)]) == 1
    # A second process maps the segment as any client does and tries to scribble on a hit.
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HARNESS_DIR)!r})
        from gateway_harness import FINGERPRINT
        from kvharbor.config import load_config
        from kvharbor.gateway.client import GatewayClient
        client = GatewayClient.connect(load_config({str(gateway.config_path)!r}).gateway, "scribbler")
        batch = client.get(FINGERPRINT, [bytes.fromhex({key.hex()!r})])
        assert len(batch.views) == 1
        print("writing", flush=True)
        batch.views[0][0] ^= 0xFF
        print("wrote", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "writing" in result.stdout and "wrote" not in result.stdout
    assert result.returncode == -11, result.stderr  # SIGSEGV: the page is read-only.
    with closing_client(gateway.client("c")) as client:
        assert get_values(client, [key]) == [value_for(key, MIB)]
