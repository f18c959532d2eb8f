"""The RAM refill beside an engine's own requests: does it starve them?

Against real ``kvharbor gateway`` subprocesses over one file tier, in one run:

1. A first gateway stores ``--objects`` values of ``--value-mb`` into its RAM
   and file tiers, then stops: the file tier is warm, no RAM tier survives.
2. **quiet**: a gateway with the refill off serves a foreground loop (put one
   new value of ``--fg-value-mb``, get it back) ``--fg-ops`` times; the p50
   and p99 of one put+get.
3. **refilling**: for each rate of ``--rates`` (MiB/s, ``storage.refill_ram_mb_per_s``),
   a new gateway with the refill on serves the same loop while its refill runs
   (samples taken only while the status says ``running``), then the refill's
   own rate to done.

Ratios: ``fg_p50_refill_vs_quiet_<rate>`` and ``fg_p99_..._<rate>`` (1.0: the
refill costs the foreground nothing). The file tier's objects were just
written, so its reads come mostly from the page cache: this measures the CPU
(verification, copies) the refill takes from requests, not the disk. Nothing
is asserted.

    .venv/bin/python bench/refill.py [--objects 256] [--value-mb 4] [--rates 256,1024] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, gateway_process

from kvharbor.cache.format import HEADER_BYTES
from kvharbor.config import GIB, MIB, GatewaySection, load_config
from kvharbor.gateway.client import GatewayClient

FINGERPRINT = b"bench-refill-lay"


@contextmanager
def gateway(directory: Path, ram_gb: float, storage: dict[str, Any]) -> Iterator[GatewaySection]:
    """A ``kvharbor gateway`` subprocess with a RAM tier over ``directory``/files."""
    name = f"bench-{uuid.uuid4().hex[:6]}"
    config_path = directory / f"{name}.yaml"
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": ram_gb},
        {"name": "local", "type": "file", "path": str(directory / "files"), "capacity_gb": 8, "fsync": False},
    ]
    section: dict[str, Any] = {
        "mode": "service",
        "socket": str(directory / f"{name}.sock"),
        "shm_name": f"kvh-bench-{name}",
    }
    section |= {"ring_mb": 256, "ring_mb_min": 1}
    config_path.write_text(yaml.safe_dump({"gateway": section, "storage": {"tiers": tiers, **storage}}))
    with gateway_process(config_path, directory / f"{name}.log", 120):
        yield load_config(config_path, environ={}).gateway


def put(client: GatewayClient, key: bytes, value: bytes) -> None:
    batch = client.prepare_put(FINGERPRINT, [(key, len(value))])
    (view,) = batch.views
    if view is not None:
        view[:] = value
    client.commit_put(batch)


def put_get(client: GatewayClient, key: bytes, value: bytes) -> float:
    """Seconds of one put and one get of ``value`` under a new ``key``."""
    started = time.perf_counter()
    put(client, key, value)
    batch = client.get(FINGERPRINT, [key])
    client.release(batch)
    return time.perf_counter() - started


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def foreground(section: GatewaySection, value: bytes, ops: int, while_refilling: bool) -> tuple[list[float], Any]:
    """Put+get timings (at most ``ops``; while refilling, only while the refill runs), and
    the refill status at the end (after waiting for it to finish)."""
    samples: list[float] = []
    client = GatewayClient.connect(section, "bench-fg")
    try:
        for _ in range(ops):
            # Both loops ask for the status between two samples, so both carry its cost.
            if client.status().refill.state != "running" and while_refilling:
                break
            samples.append(put_get(client, uuid.uuid4().bytes, value))
        if while_refilling and not samples:
            raise SystemExit(f"the refill ended before the first sample ({client.status().refill}): raise --objects")
        while client.status().refill.state == "running":
            time.sleep(0.05)  # A benchmark polling for its end, not a test's synchronisation.
        return samples, client.status().refill
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--value-mb", type=int, default=4)
    parser.add_argument("--fg-value-mb", type=int, default=1)
    parser.add_argument("--fg-ops", type=int, default=1000)
    parser.add_argument("--rates", default="256,1024", help="refill_ram_mb_per_s values, comma separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    value_bytes = args.value_mb * MIB
    fg_value = os.urandom(args.fg_value_mb * MIB)
    # Room for every stored object and every foreground value, headers included.
    ram_gb = (args.objects * (value_bytes + HEADER_BYTES) + args.fg_ops * (len(fg_value) + HEADER_BYTES)) / GIB
    figures: dict[str, Any] = {"objects": args.objects, "value_mb": args.value_mb, "cpus": os.cpu_count()}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvh-bench-refill-") as tmp:
        directory = Path(tmp)
        with gateway(directory, ram_gb, {"refill_ram": False}) as section:
            client = GatewayClient.connect(section, "bench-store")
            try:
                for _ in range(args.objects):
                    put(client, uuid.uuid4().bytes, os.urandom(value_bytes))
            finally:
                client.close()
        with gateway(directory, ram_gb, {"refill_ram": False}) as section:
            quiet, _ = foreground(section, fg_value, min(args.fg_ops, 200), while_refilling=False)
        figures["fg_p50_ms_quiet"] = round(percentile(quiet, 0.5) * 1e3, 3)
        figures["fg_p99_ms_quiet"] = round(percentile(quiet, 0.99) * 1e3, 3)
        for rate in (int(r) for r in args.rates.split(",")):
            storage = {"refill_ram": True, "refill_ram_mb_per_s": rate}
            with gateway(directory, ram_gb, storage) as section:
                busy, refill = foreground(section, fg_value, args.fg_ops, while_refilling=True)
            figures[f"fg_samples_{rate}"] = len(busy)
            figures[f"fg_p50_ms_refill_{rate}"] = round(percentile(busy, 0.5) * 1e3, 3)
            figures[f"fg_p99_ms_refill_{rate}"] = round(percentile(busy, 0.99) * 1e3, 3)
            figures[f"refill_objects_{rate}"] = refill.objects
            figures[f"refill_mb_per_s_{rate}"] = round(refill.bytes / MIB / max(refill.seconds, 1e-9), 1)
            ratios[f"fg_p50_refill_vs_quiet_{rate}"] = percentile(busy, 0.5) / percentile(quiet, 0.5)
            ratios[f"fg_p99_refill_vs_quiet_{rate}"] = percentile(busy, 0.99) / percentile(quiet, 0.99)
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
