"""One cache for two hosts: a prompt stored through host A restores through host B from S3.

    .venv/bin/python bench/shared.py [--prompt-tokens 6000] [--dtype auto] [--json]

Three network namespaces (`tests.support.netns.HostNet`): an S3 server (moto) in one,
and two hosts, each a service-mode ``kvharbor gateway`` of its own (its own RAM tier and
shared-memory segment) over the same S3 tier, reaching the server through its own network
stack only. Engines are fresh offline vLLM processes (`bench/e2e.py`'s, the CPU build, its
tiny model), attached to their host's gateway. In order:

- ``recompute``: no connector (the reference);
- ``host_a``: an engine on host A answers the prompt, which kvharbor stores in A's RAM tier
  and, from its write queue, in S3; then host A's gateway stops, writing its queue out;
- ``host_b``: an engine on host B answers the same prompt: host B's RAM tier never held it,
  so every token it takes from kvharbor came from S3 through host B.

Figures: each engine's time to first token, the tokens host B took from kvharbor beside
the bound (whole chunks of the prompt, never its last position: `tests/e2e/e2e_harness.bound`),
the objects host A left in S3, whether host B's first token is the recompute's. Ratios:
``host_b_restored_vs_bound`` (1.0: restored to the bound), ``host_b_ttft_vs_recompute``.
Never asserts on time.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import e2e  # noqa: E402
from common import emit, gateway_process, run_engine_process  # noqa: E402

from kvharbor.demo.dtype import choose_dtype  # noqa: E402
from kvharbor.demo.model import build_tiny_model  # noqa: E402
from kvharbor.hal.s3 import RECORDS  # noqa: E402
from tests.e2e.e2e_harness import bound  # noqa: E402
from tests.support.netns import HostNet, netns_works  # noqa: E402
from tests.support.s3_server import MotoServer, credentials_in_env, s3_tier  # noqa: E402

HOSTS = ("a", "b")
GATEWAY_START_S = 60
RAM_TIER_GB = 1
S3_CAPACITY_GB = 4


def host_config(workdir: Path, host: str, server: MotoServer, bucket: str) -> Path:
    """Host ``host``'s config: its service gateway, its RAM tier, the shared S3 tier."""
    path = workdir / f"host-{host}.yaml"
    config = {
        "gateway": {
            "mode": "service",
            "socket": str(workdir / f"host-{host}.sock"),
            "shm_name": f"kvh-bench-{host}-{uuid.uuid4().hex[:8]}",
            "ring_mb": 256,
        },
        "storage": {
            "tiers": [
                {"name": "ram", "type": "ram", "capacity_gb": RAM_TIER_GB},
                s3_tier(server.url, bucket, capacity_gb=S3_CAPACITY_GB, read_timeout_ms=30_000),
            ],
            "fallback_path": None,  # S3 is the persistent tier: nothing may land on the local disk.
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def stored_objects(server: MotoServer, bucket: str) -> int:
    """The values in ``bucket`` (not the tier's own records, `RECORDS`)."""
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sum(1 for page in pages for item in page.get("Contents", ()) if RECORDS not in item["Key"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    why = netns_works()
    if why is not None:
        raise SystemExit(f"bench: network namespaces cannot be made here (run as root): {why}")
    if args.dtype == "auto":
        choice = choose_dtype()
        args.dtype = choice.dtype
        print(f"bench: {args.dtype}: {choice.reason}", flush=True)
    rng = random.Random(args.prompt_tokens)
    prompt = [rng.randrange(4, 4096) for _ in range(args.prompt_tokens)]
    warmup = [rng.randrange(4, 4096) for _ in range(e2e.WARMUP_TOKENS)]
    with tempfile.TemporaryDirectory(prefix="kvh-bench-shared-") as root:
        workdir = Path(root)
        tmp = workdir / "tmp"
        tmp.mkdir()
        model = build_tiny_model(workdir / "model", max_position=8192, **e2e.MODEL)
        spec = {"model": str(model), "dtype": args.dtype, "prompt": prompt, "warmup": warmup}

        def engine(name: str, config: Path | None) -> dict[str, Any]:
            env = {} if config is None else {"KVHARBOR": "1", "KVHARBOR_CONFIG": str(config)}
            result = run_engine_process(e2e.__file__, spec, env, workdir, tmp, name)
            print(f"{name:<10} TTFT {result['ttft_s']:.3f} s, {result['cached']} tokens cached", flush=True)
            return result

        net = HostNet(["s3", *HOSTS])
        try:
            server = MotoServer(host=net.addresses["s3"], prefix=net.prefix("s3"))
            try:
                bucket = server.bucket()
                configs = {host: host_config(workdir, host, server, bucket) for host in HOSTS}
                recompute = engine("recompute", None)
                with credentials_in_env(server.credentials):  # The gateways' AWS chain.
                    with gateway_process(configs["a"], workdir / "gateway-a.log", GATEWAY_START_S, net.prefix("a")):
                        host_a = engine("host_a", configs["a"])
                    # Host A's gateway has stopped: its write queue is in S3, its RAM tier gone.
                    objects = stored_objects(server, bucket)
                    with gateway_process(configs["b"], workdir / "gateway-b.log", GATEWAY_START_S, net.prefix("b")):
                        host_b = engine("host_b", configs["b"])
            finally:
                server.stop()
        finally:
            net.close()
    limit = bound(len(prompt))
    figures: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "dtype": args.dtype,
        "bound_tokens": limit,
        "s3_objects_after_host_a": objects,
        "host_b_restored_tokens": host_b["cached"],
        "host_b_same_first_token": host_b["first_token"] == recompute["first_token"],
        "host_a_same_first_token": host_a["first_token"] == recompute["first_token"],
        "recompute_ttft_s": recompute["ttft_s"],
        "host_a_ttft_s": host_a["ttft_s"],
        "host_b_ttft_s": host_b["ttft_s"],
        "host_b_kvharbor_loaded_MiB": host_b["kvharbor_loaded_bytes"] / 2**20,
    }
    ratios = {
        "host_b_restored_vs_bound": host_b["cached"] / limit,
        "host_b_ttft_vs_recompute": host_b["ttft_s"] / recompute["ttft_s"],
        "host_a_ttft_vs_recompute": host_a["ttft_s"] / recompute["ttft_s"],
    }
    print(f"a {len(prompt)}-token prompt stored through host A, restored through host B from one S3 tier:")
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
