"""The RAM tier lives in the gateway's segment: hits are served from it in place, puts are
written into it in place, and clients cannot write a stored value."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from gateway_harness import (
    FINGERPRINT,
    GatewayProcess,
    Lab,
    closing_client,
    fill,
    get_values,
    keys_of,
    put_values,
    value_for,
)

from kvharbor.cache.format import HEADER_BYTES, parse_header
from kvharbor.config import MIB
from kvharbor.gateway.client import GatewayClient
from kvharbor.hal.checksum import checksum
from kvharbor.hal.extents import PAGE_BYTES

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
            status = client.status().shm
            assert status.pinned == 4 and status.free_bytes == ring
        finally:
            client.release(batch)
        assert client.status().shm.pinned == 0
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


# -- puts written in place ------------------------------------------------------------


def test_puts_are_written_in_place_in_the_ram_tier(started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=8)
    items = [(key, 3 * MIB) for key in keys_of(2, tag=13)]
    with closing_client(gateway.client("c")) as client:
        ring = client.hello.ring_bytes
        batch = client.prepare_put(FINGERPRINT, items)
        spans = [address_in(client, view) for view in batch.views]
        # 6 MiB lent beyond the ring, the values' final places; of the ring only a page
        # for the batch's completion marks.
        assert all(offset >= ring for offset in spans)
        shm = client.status().shm
        assert shm.free_bytes == ring - PAGE_BYTES and shm.in_place_bytes == 6 * MIB
        assert batch.views[0] is not None
        batch.views[0][:] = value_for(*items[0])  # Filled by hand: the gateway checksums it.
        batch.write(1, value_for(*items[1]))  # Copied with its checksum, sent with the commit.
        assert batch.commit_checksums() == [], "not every value came with a checksum: none are sent"
        assert client.commit_put(batch) == 2
        assert client.status().shm.in_place_bytes == 0
        hits = client.get(FINGERPRINT, [k for k, _ in items])
        try:
            # Served from where they were written: nothing was copied to store them.
            assert [address_in(client, view) for view in hits.views] == spans
            assert [bytes(view) for view in hits.views] == [value_for(k, n) for k, n in items]
            for offset, (key, size) in zip(spans, items, strict=True):
                header = parse_header(client.segment.view[offset - HEADER_BYTES : offset])
                assert header.key == key and header.payload_checksum == checksum(value_for(key, size))
        finally:
            client.release(hits)


def test_a_writer_that_checksums_every_value_sends_the_checksums(started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=8)
    items = [(key, MIB) for key in keys_of(2, tag=19)]
    with closing_client(gateway.client("c")) as client:
        batch = client.prepare_put(FINGERPRINT, items)
        for index, item in enumerate(items):
            batch.write(index, value_for(*item))
        assert batch.commit_checksums() == [checksum(value_for(*item)) for item in items]
        assert client.commit_put(batch) == 2
        assert get_values(client, [k for k, _ in items]) == [value_for(k, n) for k, n in items]


def test_in_flight_puts_in_place_are_bounded_by_their_own_budget(started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=8, in_place_mb_max=7)
    items = [(key, 3 * MIB) for key in keys_of(3, tag=14)]
    with closing_client(gateway.client("c")) as client:
        ring = client.hello.ring_bytes
        batch = client.prepare_put(FINGERPRINT, items)
        offsets = [address_in(client, view) for view in batch.views]
        # Two fit gateway.in_place_mb_max in place; the third goes through the ring.
        assert [offset >= ring for offset in offsets] == [True, True, False]
        fill(batch, items)
        assert client.commit_put(batch) == 3
        assert get_values(client, [k for k, _ in items]) == [value_for(k, n) for k, n in items]
        shm = client.status().shm
        assert shm.free_bytes == ring and shm.in_place_bytes == 0


def test_a_batch_larger_than_the_ring_goes_in_place_whole(started: Callable[..., GatewayProcess]) -> None:
    """A GPU step's saves (2 GiB at 16,384 tokens of an 8B model) outgrow the ring: they
    must all be lent in place, or each step's last chunk is skipped and every chunk
    after it in the prompt is unreachable (seen on the H200 with the ring's 1 GiB)."""
    gateway = started(ring_mb=8)
    items = [(key, 3 * MIB) for key in keys_of(5, tag=24)]
    with closing_client(gateway.client("c")) as client:
        ring = client.hello.ring_bytes
        batch = client.prepare_put(FINGERPRINT, items)
        assert all(view is not None and address_in(client, view) >= ring for view in batch.views)
        fill(batch, items)
        assert client.commit_put(batch) == 5
        assert get_values(client, [k for k, _ in items]) == [value_for(k, n) for k, n in items]
        assert client.status().counters["ring_full"] == 0


def test_puts_go_through_the_ring_when_the_first_tier_is_not_in_shared_memory(
    lab: Lab, started: Callable[..., GatewayProcess]
) -> None:
    gateway = started(
        ring_mb=8, tiers=[{"name": "disk", "type": "file", "path": str(lab.tmp_path / "t"), "capacity_gb": 0.1}]
    )
    items = [(key, MIB) for key in keys_of(2, tag=15)]
    with closing_client(gateway.client("c")) as client:
        batch = client.prepare_put(FINGERPRINT, items)
        assert all(address_in(client, view) < client.hello.ring_bytes for view in batch.views)
        assert batch.in_place == []
        fill(batch, items)
        assert client.commit_put(batch) == 2
        assert get_values(client, [k for k, _ in items]) == [value_for(k, n) for k, n in items]


def test_a_put_in_place_is_read_only_once_committed(started: Callable[..., GatewayProcess]) -> None:
    """The client may write its lent place until it commits, never after: a stored
    value can only change through the gateway."""
    gateway = started(ring_mb=8)
    key = keys_of(1, tag=16)[0]
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HARNESS_DIR)!r})
        from gateway_harness import FINGERPRINT, value_for
        from kvharbor.config import MIB, load_config
        from kvharbor.gateway.client import GatewayClient
        client = GatewayClient.connect(load_config({str(gateway.config_path)!r}).gateway, "late writer")
        key = bytes.fromhex({key.hex()!r})
        batch = client.prepare_put(FINGERPRINT, [(key, MIB)])
        assert batch.in_place, "lent in place"
        batch.views[0][:] = value_for(key, MIB)
        assert client.commit_put(batch) == 1
        print("committed", flush=True)
        batch.views[0][0] ^= 0xFF
        print("wrote", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "committed" in result.stdout and "wrote" not in result.stdout, result.stderr
    assert result.returncode == -11, result.stderr  # SIGSEGV: read-only again after the commit.
    with closing_client(gateway.client("c")) as client:
        assert get_values(client, [key]) == [value_for(key, MIB)]


def test_room_for_a_put_in_place_comes_from_the_least_recent_values(
    started: Callable[..., GatewayProcess],
) -> None:
    gateway = started(ring_mb=8, tiers=[{"name": "ram", "type": "ram", "capacity_gb": 24 / 1024}])
    old = [(key, 4 * MIB) for key in keys_of(5, tag=17)]
    new = [(key, 4 * MIB) for key in keys_of(2, tag=18)]
    with closing_client(gateway.client("c")) as client:
        for item in old:
            assert put_values(client, [item]) == 1
        assert get_values(client, [old[0][0]]) == [value_for(*old[0])]  # Now the most recent.
        assert put_values(client, new) == 2
        assert get_values(client, [k for k, _ in new]) == [value_for(k, n) for k, n in new]
        kept = [client.lookup([key]) for key, _ in old]
        assert kept[0] == 1, "the value read last stays"
        assert sum(kept) <= 3, "older values made room"
        tier = client.status().store.tiers[0]
        assert tier.used_bytes <= tier.capacity_bytes


def address_in(client: GatewayClient, view: memoryview | None) -> int:
    """Where ``view`` starts in the client's mapping of the segment."""
    assert view is not None
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) - ctypes.addressof(
        ctypes.c_char.from_buffer(client.segment.view)
    )
