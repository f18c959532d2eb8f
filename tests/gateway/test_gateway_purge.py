"""``kvharbor purge`` through a running gateway (PURGE): a real gateway with a RAM tier
and a file tier, real clients storing values under two namespaces and layouts, and the
real CLI (`kvharbor.cli.main`) asking the gateway to purge."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvharbor.cache.keys import LayoutFingerprint, namespace_tag, short_digest
from kvharbor.cache.purge import PurgeFilter
from kvharbor.cli import main
from kvharbor.config import FileTierSection
from tests.support.real_gateway import RealGateway

ALPHA = LayoutFingerprint(model_id="m", chunk_size=16, key_namespace="alpha")
BETA = LayoutFingerprint(model_id="m", chunk_size=16, key_namespace="beta")
VALUE = os.urandom(4096)
PER_LAYOUT = 5


def keys(prefix: int) -> list[bytes]:
    return [bytes([prefix, i]) * 8 for i in range(PER_LAYOUT)]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[RealGateway]:
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.05},
        {"name": "local", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 0.05},
    ]
    gw = RealGateway(tmp_path, tiers=tiers).start()
    try:
        for fingerprint, prefix in ((ALPHA, 1), (BETA, 2)):
            client = gw.client()
            try:
                batch = client.prepare_put(
                    fingerprint.digest(),
                    [(k, len(VALUE)) for k in keys(prefix)],
                    namespace_tag(fingerprint.key_namespace),
                )
                for view in batch.views:
                    assert view is not None
                    view[:] = VALUE
                assert client.commit_put(batch) == PER_LAYOUT
            finally:
                client.close()
        gw.settle()  # The file tier is written from its queue: every test starts with it full.
        yield gw
    finally:
        gw.close()


def purge_cli(gw: RealGateway, *args: str) -> int:
    return main(["purge", *args, "--config", str(gw.config_path)])


def test_without_yes_it_says_what_would_go_per_tier_and_removes_nothing(
    gateway: RealGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    assert purge_cli(gateway, "--namespace", "alpha") == 0
    out = capsys.readouterr().out
    assert f"via gateway pid {os.getpid()}" in out
    assert "tier ram: would remove 5 values" in out and "tier local: would remove 5 values" in out
    assert "nothing removed yet: pass --yes" in out
    assert gateway.holds(keys(1)) == PER_LAYOUT and gateway.holds(keys(2)) == PER_LAYOUT


def files_in(gw: RealGateway) -> int:
    tier = gw.config.storage.tiers[1]
    assert isinstance(tier, FileTierSection), tier
    return sum(1 for path in Path(tier.path).rglob("*") if path.is_file())


def test_namespace_purge_removes_that_namespace_from_every_tier_and_keeps_the_other(
    gateway: RealGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    files_before = files_in(gateway)
    assert purge_cli(gateway, "--namespace", "alpha", "--yes", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["applied"] is True
    assert {t["tier"]: t["objects"] for t in report["tiers"]} == {"ram": PER_LAYOUT, "local": PER_LAYOUT}
    assert all(t["nbytes"] > PER_LAYOUT * len(VALUE) for t in report["tiers"])
    assert gateway.holds(keys(1)) == 0
    assert gateway.holds(keys(2)) == PER_LAYOUT
    tiers = {t.name: t for t in gateway.status().store.tiers}
    assert tiers["ram"].keys == PER_LAYOUT and tiers["local"].keys == PER_LAYOUT
    assert files_in(gateway) == files_before - PER_LAYOUT  # The objects went, not only their index entries.


def test_layout_purge_takes_the_short_digest_status_shows(
    gateway: RealGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    layout_id = short_digest(BETA.digest())
    assert f"#{layout_id}" in BETA.short()
    assert purge_cli(gateway, "--layout", f"#{layout_id.upper()}", "--yes") == 0
    assert "tier ram: removed 5 values" in capsys.readouterr().out
    assert gateway.holds(keys(2)) == 0
    assert gateway.holds(keys(1)) == PER_LAYOUT


def test_a_value_read_in_place_keeps_its_bytes_until_the_reader_releases_it(gateway: RealGateway) -> None:
    reader = gateway.client("reader")
    try:
        held = reader.get(ALPHA.digest(), keys(1)[:1])
        assert len(held.views) == 1
        report = gateway.client().purge(PurgeFilter(namespace="alpha"), apply=True)
        assert report.objects == 2 * PER_LAYOUT
        assert gateway.holds(keys(1)[:1]) == 0  # Gone for every later lookup...
        assert bytes(held.views[0]) == VALUE  # ...but not from under the reader.
        reader.release(held)
    finally:
        reader.close()


def test_older_than_keeps_what_was_used_recently(gateway: RealGateway, capsys: pytest.CaptureFixture[str]) -> None:
    assert purge_cli(gateway, "--older-than", "1h", "--yes", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["objects"] for t in report["tiers"]] == [0, 0]
    assert gateway.holds(keys(1)) == PER_LAYOUT


def test_a_gateway_of_another_config_is_not_purged_behind(
    gateway: RealGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Same socket, another storage section: the gateway refuses the handshake, and the
    # purge must not fall back to the files that gateway serves from RAM.
    other = tmp_path / "other.yaml"
    document = gateway.config_path.read_text().replace("capacity_gb: 0.05", "capacity_gb: 0.06")
    other.write_text(document)
    assert main(["purge", "--namespace", "alpha", "--yes", "--config", str(other)]) == 2
    err = capsys.readouterr().err
    assert "cannot be asked to purge" in err and "CONFIG_MISMATCH" in err and "nothing was removed" in err
    assert gateway.holds(keys(1)) == PER_LAYOUT


def layout_counts(gw: RealGateway) -> dict[str, dict[str, int]]:
    """Objects per layout digest, per tier, as the gateway's status says."""
    return {tier.name: tier.layouts for tier in gw.status().store.tiers}


def test_status_counts_each_layouts_objects_per_tier_through_a_purge_and_a_restart(gateway: RealGateway) -> None:
    alpha, beta = ALPHA.digest().hex(), BETA.digest().hex()
    both = {alpha: PER_LAYOUT, beta: PER_LAYOUT}
    assert layout_counts(gateway) == {"ram": both, "local": both}
    assert purge_cli(gateway, "--layout", f"#{short_digest(BETA.digest())}", "--yes") == 0
    assert layout_counts(gateway) == {"ram": {alpha: PER_LAYOUT}, "local": {alpha: PER_LAYOUT}}
    gateway.stop()
    gateway.start()
    # The file tier's counts come back from its manifest; the RAM tier starts empty and
    # what refills it from the file tier is alpha's, as far as it got.
    counts = layout_counts(gateway)
    assert counts["local"] == {alpha: PER_LAYOUT}
    assert set(counts["ram"]) <= {alpha}
