"""A real gateway whose persistent tiers are all skipped: it says why, and the fallback serves.

The nfs tier points at a directory that is no NFS mount on this host (the gateway
reads the real /proc/self/mountinfo) and the file tier lacks its path: both are
skipped with their reasons, writes go to ``storage.fallback_path``, and ``kvharbor
status`` shows that tier as the fallback and the skipped ones with why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gateway_harness import Lab, closing_client, get_values, put_values, value_for
from ops_harness import kvharbor_cmd


def test_skipped_tiers_are_said_and_the_fallback_serves_and_shows(lab: Lab, tmp_path: Path) -> None:
    (tmp_path / "export").mkdir()
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.01},
        {"name": "filer", "type": "nfs", "path": str(tmp_path / "export"), "capacity_gb": 1},
        {"name": "disk", "type": "file", "capacity_gb": 1},
    ]
    fallback = tmp_path / "fallback"
    storage = {"fallback_path": str(fallback), "fallback_capacity_gb": 0.05}
    config = lab.config(tiers=tiers, storage=storage)
    gateway = lab.gateway(config).start()
    log = gateway.log()
    assert (
        f"kvharbor: tier filer unavailable: nfs tier 'filer': path {tmp_path / 'export'} is not a mount point "
        "(not in /proc/self/mountinfo); mount the export before starting; skipping"
    ) in log
    assert "kvharbor: tier disk unavailable: tier 'disk' (type file) requires 'path'; skipping" in log
    assert (
        f"kvharbor: no persistent tier available (skipped: filer, disk); writing KV to local fallback {fallback} "
        "(0.05 GiB, storage.fallback_path, storage.fallback_capacity_gb)"
    ) in log
    assert list((tmp_path / "export").iterdir()) == [], "nothing written where no export is mounted"

    items = [(bytes([7, i]) * 8, 50_000) for i in range(3)]
    with closing_client(gateway.client()) as client:
        assert put_values(client, items) == 3
        assert get_values(client, [key for key, _ in items]) == [value_for(*item) for item in items]
    assert len(list(fallback.glob("*/*/*"))) == 3, "written through to the fallback directory"

    human = kvharbor_cmd("status", "--config", str(config))
    assert human.returncode == 0, human.stderr
    # The fallback's health is the host disk's: degraded where less than 5% of it is free.
    condition = r"(ok|degraded: \S+: [\d.]+% of the filesystem free)"
    assert re.search(rf"fallback \[file, fallback\]: {condition}; .*, 3 objects,", human.stdout), human.stdout
    assert "filer: unavailable: nfs tier 'filer'" in human.stdout
    assert "disk: unavailable: tier 'disk' (type file) requires 'path'" in human.stdout
    machine = json.loads(kvharbor_cmd("status", "--config", str(config), "--json").stdout)
    shown = {tier["name"]: tier["fallback"] for tier in machine["store"]["tiers"]}
    assert shown == {"ram": False, "fallback": True}
    gateway.stop()
