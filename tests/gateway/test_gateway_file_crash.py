"""A gateway killed with SIGKILL in the middle of writing a file tier, then restarted.

The writer of a file tier is the gateway: a client streams puts of large values,
the test freezes the gateway (SIGSTOP) at a moment a value's temp file is on disk
(a write in flight, seen on the filesystem itself), then kills it (SIGKILL). The
restarted gateway must serve every acknowledged value byte for byte, nothing
corrupt or partial for the value that was in flight, leave no temp file behind,
and its manifest must agree with the files on disk.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from gateway_harness import WAIT_S, Lab, closing_client, get_values, value_for

from kvharbor.cache.manifest import ManifestReader
from kvharbor.hal.tempfiles import TEMP_SUFFIX

VALUE_BYTES = 4 << 20
"""Large enough that a put spends most of its time writing and flushing its file."""
ACKED_BEFORE_KILL = 3
_VALUE_NAME = re.compile(r"[0-9a-f]{32}")


def files_under(root: Path) -> tuple[list[Path], list[Path]]:
    """(value files, temp files) under the tier's root."""
    values, temps = [], []
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(TEMP_SUFFIX):
                temps.append(Path(directory) / name)
            elif _VALUE_NAME.fullmatch(name):
                values.append(Path(directory) / name)
    return values, temps


def freeze_mid_write(pid: int, root: Path) -> list[Path]:
    """SIGSTOP the gateway at a moment one of its temp files is on disk; the temp files then."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if files_under(root)[1]:
            os.kill(pid, signal.SIGSTOP)
            temps = files_under(root)[1]
            if temps:
                return temps  # Frozen with a write in flight.
            os.kill(pid, signal.SIGCONT)  # Renamed in between: try again.
    raise AssertionError(f"no write in flight seen under {root} within {WAIT_S} s")


def test_a_gateway_killed_mid_write_restarts_serving_nothing_corrupt(lab: Lab, tmp_path: Path) -> None:
    root = tmp_path / "files"
    config_path = lab.config(tiers=[{"name": "local", "type": "file", "path": str(root), "capacity_gb": 0.25}])
    gateway = lab.gateway(config_path).start()
    writer = lab.worker("put-forever", str(config_path), str(VALUE_BYTES))
    acked = [int(writer.line().split()[1]) for _ in range(ACKED_BEFORE_KILL)]
    torn = freeze_mid_write(gateway.pid, root)
    gateway.kill()  # SIGKILL, then reaped.
    writer.kill()
    assert all(path.exists() for path in torn), "the kill left the in-flight write's temp file"
    acked_before = max(acked)

    restarted = lab.gateway(config_path).start()
    values, temps = files_under(root)
    assert temps == [], f"temp files of the killed writer were not swept: {temps}"
    assert f"removed {len(torn)} temp files left by interrupted writes in {root}" in restarted.log()
    with closing_client(restarted.client()) as client:
        keys = [n.to_bytes(16, "big") for n in range(len(values) + 2)]
        held = client.lookup(keys)
        assert held >= acked_before + 1, f"acknowledged values lost: {held} held, {acked_before + 1} acknowledged"
        got = get_values(client, keys[:held])
        assert len(got) == held, (len(values), held, acked, torn, client.status().store.tiers[0], restarted.log())
        for n, value in enumerate(got):
            assert value == value_for(keys[n], VALUE_BYTES), f"value {n} differs from what was stored"
        tier = client.status().store.tiers[0]
        assert tier.counters.corrupt == 0
    # The manifest and the files agree: one entry per value file, no more, no fewer.
    reader = ManifestReader(str(root))
    try:
        objects, _ = reader.totals()
    finally:
        reader.close()
    assert objects == len(values) == tier.keys, (objects, len(values), tier.keys)
    restarted.stop()
