"""What must never hit: another tenant's salt, another layout, another model; and what must never
share a gateway: another storage config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from e2e_harness import OFF_LINE, Lab, bound, request, tokens

from kvharbor.demo.model import build_tiny_model

pytestmark = pytest.mark.e2e

LONG = tokens(1001, seed=11)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights: its KV must never be read as the first model's."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "other", seed=7)


def test_salts_isolate_tenants(lab: Lab) -> None:
    first = lab.run({"rounds": [[request(LONG, "tenantA")], [request(LONG, "tenantB")]]}).ok()
    assert [r["external_hits"] for r in first.rounds()] == [0, 0]
    assert [r["cached"] for r in first.requests().values()] == [0, 0]  # vLLM's own cache is salted too

    restarted = lab.run({"rounds": [[request(LONG, "tenantA")], [request(LONG, "tenantC")], [request(LONG)]]}).ok()
    hits = [r["external_hits"] for r in restarted.rounds()]
    assert hits == [bound(len(LONG)), 0, 0]
    assert restarted.requests()["0.0"]["cached"] == bound(len(LONG))


def test_a_layout_change_never_hits(lab: Lab, other_model: Path) -> None:
    lab.run({"rounds": [[request(LONG)]]}).ok()
    assert lab.stored_objects() == len(LONG) // 256

    bigger_chunks = lab.run({"rounds": [[request(LONG)]]}, lab.env(KVHARBOR__ENGINE__CHUNK_SIZE="512")).ok()
    assert bigger_chunks.rounds()[0]["external_hits"] == 0
    assert lab.stored_objects() == len(LONG) // 256 + len(LONG) // 512  # Its own keys, beside the old.
    assert "chunk 512 tokens" in bigger_chunks.log

    other = lab.run({"model": str(other_model), "rounds": [[request(LONG)]]}).ok()
    assert other.rounds()[0]["external_hits"] == 0
    assert other.metrics()["vllm:kvharbor_load_errors"] == 0

    # The original layout still finds its own chunks: the misses above were the layout's doing.
    again = lab.run({"rounds": [[request(LONG)]]}).ok()
    assert again.rounds()[0]["external_hits"] == bound(len(LONG))


def test_two_configs_at_once_keep_to_their_own_gateways(lab: Lab) -> None:
    """Two engines of two storage configs, started together, with gateway.socket left
    ``derived``: each starts a gateway of its own and stores in its own tier (sharing
    one, the second's chunks would be skipped as already stored in the first's)."""
    engines = []
    for name in ("first", "second"):
        document = {"gateway": {"ring_mb": 64, "shm_reserve_mb": 0},
                    "storage": {"tiers": [{"name": "local", "type": "file", "path": str(lab.root / name),
                                           "capacity_gb": 2}]}}  # fmt: skip
        path = lab.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(document))
        # A short runtime directory of the test's own, where the derived sockets go.
        engines.append(
            ({"rounds": [[request(LONG)]]}, lab.env(KVHARBOR_CONFIG=str(path), XDG_RUNTIME_DIR=str(lab.runtime)))
        )
    runs = [run.ok() for run in lab.run_together(engines)]
    gateway_pids = set()
    for run in runs:
        started = re.findall(r"kvharbor: started an embedded gateway \(pid (\d+)\)", run.log)
        assert len(started) == 1, run.log
        gateway_pids.add(started[0])
        assert OFF_LINE not in run.log
    assert len(gateway_pids) == 2
    for name in ("first", "second"):
        assert lab.stored_objects(lab.root / name) == len(LONG) // 256, name
