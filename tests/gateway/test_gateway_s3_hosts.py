"""One cache for many hosts: three real gateways, each in a network namespace of its own,
share an S3 tier on one real S3 server (moto) in a fourth.

Host B and host C hit what host A stored; the tier's budget holds for all three together,
kept by the one host holding the evictor's lease; when that host is killed, another takes
the lease over and keeps the budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import (
    WAIT_S,
    GatewayProcess,
    Lab,
    closing_client,
    get_values,
    put_values,
    value_for,
    wait_until,
)

from kvharbor.cache.shared import LEASE_RECORD, LeaseBody
from kvharbor.cache.tier import TierStatus
from tests.support.netns import HostNet, netns_works
from tests.support.s3_server import MotoServer, s3_tier

HOSTS = ["a", "b", "c"]
VALUE_BYTES = 100_000
CAPACITY_GB = 0.002
"""About 2.1 MB for the three hosts together: 21 values of 100 kB (with their headers)."""


@pytest.fixture
def net() -> Iterator[HostNet]:
    why = netns_works()
    assert why is None, f"network namespaces cannot be made here: {why}"
    net = HostNet(["s3", *HOSTS])
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def s3(net: HostNet) -> Iterator[MotoServer]:
    server = MotoServer(host=net.addresses["s3"], prefix=net.prefix("s3"))
    try:
        yield server
    finally:
        server.stop()


def start_hosts(
    lab: Lab, net: HostNet, s3: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, GatewayProcess]:
    for name, value in s3.credentials.env().items():
        monkeypatch.setenv(name, value)  # The gateways' AWS chain: their environment.
    tier = s3_tier(
        s3.url, bucket, capacity_gb=CAPACITY_GB, budget_interval_s=0.5, lease_s=8.0, miss_ttl_ms=0, read_timeout_ms=5000
    )
    gateways = {}
    for host in HOSTS:
        config = lab.config(host, tiers=[{"name": "ram", "type": "ram", "capacity_gb": 0.05}, tier])
        gateways[host] = lab.gateway(config, prefix=net.prefix(host)).start()
    return gateways


def lease_of(s3: MotoServer, bucket: str) -> LeaseBody | None:
    try:
        body = s3.client().get_object(Bucket=bucket, Key=f"kvharbor/_kvharbor/{LEASE_RECORD}")["Body"].read()
    except s3.client().exceptions.NoSuchKey:
        return None
    return LeaseBody.decode(body)


def stored_bytes(s3: MotoServer, bucket: str) -> int:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="kvharbor/")
    return sum(item["Size"] for page in pages for item in page.get("Contents", ()) if "_kvharbor/" not in item["Key"])


def s3_status(gateway: GatewayProcess) -> TierStatus:
    with closing_client(gateway.client("status")) as client:
        (tier,) = [t for t in client.status().store.tiers if t.name == "s3"]
    return tier


def settled(lease: LeaseBody | None, stored: int) -> bool:
    return lease is not None and lease.used_bytes == stored


def holder_pid(lease: LeaseBody | None) -> int | None:
    return None if lease is None else int(lease.holder.split(":")[1])


def test_three_hosts_share_one_s3_tier_and_its_budget(
    lab: Lab, net: HostNet, s3: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bucket = s3.bucket()
    gateways = start_hosts(lab, net, s3, bucket, monkeypatch)
    pids = {gateway.pid: host for host, gateway in gateways.items()}

    # Host B and host C hit what host A stored: their RAM tiers never held it.
    items = [(bytes([0xA0, i]) * 8, VALUE_BYTES) for i in range(5)]
    with closing_client(gateways["a"].client("writer-a")) as a:
        assert put_values(a, items) == len(items)
    for host in ("b", "c"):
        with closing_client(gateways[host].client(f"reader-{host}")) as reader:
            got = get_values(reader, [key for key, _ in items])
            assert got == [value_for(key, size) for key, size in items], f"host {host} did not hit"

    # Every host writes past the shared budget; the one lease holder keeps it for all.
    for number, host in enumerate(HOSTS):
        with closing_client(gateways[host].client(f"filler-{host}")) as client:
            more = [(bytes([0xB0 + number, i]) * 8, VALUE_BYTES) for i in range(12)]
            assert put_values(client, more) == len(more)
    capacity_bytes = int(CAPACITY_GB * 2**30)
    assert stored_bytes(s3, bucket) > capacity_bytes  # 41 values of 100 kB were written.
    wait_until(lambda: stored_bytes(s3, bucket) <= capacity_bytes, "the shared budget kept")
    # Nothing is written now: once the lease record holds the totals of the last sweep, they are final.
    wait_until(lambda: settled(lease_of(s3, bucket), stored_bytes(s3, bucket)), "the lease record's totals")
    lease = lease_of(s3, bucket)
    assert lease is not None and lease.evicted > 0
    holder = holder_pid(lease)
    assert holder in pids, f"the lease is held by {lease.holder}, none of the gateways {sorted(pids)}"
    assert sum("values evicted to keep the shared budget" in gw.log() for gw in gateways.values()) == 1
    # Each host's status shows the shared tier's totals; the holder's counts what it evicted.
    for host, gateway in gateways.items():
        wait_until(
            lambda gateway=gateway: 0 < s3_status(gateway).used_bytes <= capacity_bytes,
            f"host {host} showing the shared totals",
        )
        expected_evictions = lease.evicted if gateway.pid == holder else 0
        assert s3_status(gateway).counters.evictions == expected_evictions, host

    # The holder dies; another host takes the lease over once it lapses and keeps the budget.
    gateways[pids[holder]].kill()
    wait_until(lambda: holder_pid(lease_of(s3, bucket)) not in (None, holder), "another host taking the lease", WAIT_S)
    successor = holder_pid(lease_of(s3, bucket))
    assert successor in pids and successor != holder
    with closing_client(gateways[pids[successor]].client("filler-again")) as client:
        more = [(bytes([0xC0, i]) * 8, VALUE_BYTES) for i in range(12)]
        assert put_values(client, more) == len(more)
    wait_until(lambda: stored_bytes(s3, bucket) <= capacity_bytes, "the budget kept by the successor")
