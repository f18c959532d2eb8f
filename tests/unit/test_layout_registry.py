"""The layout registry's files: written whole, read back after a restart, shared by the
gateways of one directory, and a damaged or unwritable one never stops a gateway."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.gateway.layouts import LayoutRegistry, read_registry_file, registry_path
from tests.support.status_sample import LAYOUT

OTHER = dataclasses.replace(LAYOUT, kv_dtype="fp8")


def test_canonical_fingerprints_round_trip_exactly_and_anything_else_is_refused() -> None:
    assert LayoutFingerprint.from_canonical(LAYOUT.canonical()) == LAYOUT
    spaced = LAYOUT.canonical().replace(b",", b", ", 1)
    for bad, why in [
        (spaced, "encode to other bytes"),
        (b'{"encoding": 2, "layout": {}}', "encoding 2"),
        (b'{"encoding": 1, "layout": {"model_id": "m"}}', "it has no field 'kv_shapes'"),
        (b"[]", "not a canonical layout fingerprint"),
    ]:
        with pytest.raises(ValueError, match=why):
            LayoutFingerprint.from_canonical(bad)


def test_differing_fields_name_each_field_and_each_extra_by_name() -> None:
    other = dataclasses.replace(LAYOUT, kv_dtype="fp8", tp_rank=0, extra=(("device", "cuda"),))
    assert LAYOUT.differing_fields(other) == ["kv_dtype", "extra.device"]
    assert LAYOUT.differing_fields(LAYOUT) == []


def test_a_registry_is_written_beside_each_tier_and_read_back_by_the_next_gateway(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    first = LayoutRegistry([str(d) for d in dirs], start_clean=False)
    first.register([LAYOUT], "engine-a")
    for d in dirs:
        assert [layout.fingerprint for layout in read_registry_file(registry_path(d))] == [LAYOUT]
    assert sorted(p.name for p in dirs[0].iterdir()) == ["layouts.json"], "no temp file left behind"
    (known,) = LayoutRegistry([str(dirs[1])], start_clean=False).layouts()
    assert known.fingerprint == LAYOUT and known.registered_by == "engine-a" and not known.this_run


def test_gateways_sharing_a_directory_keep_each_others_layouts(tmp_path: Path) -> None:
    one, two = LayoutRegistry([str(tmp_path)], False), LayoutRegistry([str(tmp_path)], False)
    one.register([LAYOUT], "engine-a")
    two.register([OTHER], "engine-b")
    on_disk = {layout.fingerprint for layout in read_registry_file(registry_path(tmp_path))}
    assert on_disk == {LAYOUT, OTHER}
    LayoutRegistry([str(tmp_path)], start_clean=True)
    assert read_registry_file(registry_path(tmp_path)) == [], "start-clean empties it, whoever wrote it"


def test_a_damaged_registry_is_ignored_once_and_rewritten(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = registry_path(tmp_path)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        registry = LayoutRegistry([str(tmp_path)], start_clean=False)
    assert registry.layouts() == []
    assert [r.message for r in caplog.records if "ignored" in r.message] == [
        f"kvharbor: layout registry {path} ignored ({path} is not a layout registry: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "it is rewritten at the next registration"
    ]
    registry.register([LAYOUT], "engine-a")
    assert json.loads(path.read_text())["layouts"][0]["short"] == LAYOUT.short()


def test_an_unwritable_registry_is_said_once_and_the_registry_still_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "gone"  # A tier directory removed under the gateway.
    registry = LayoutRegistry([str(missing)], start_clean=False)
    with caplog.at_level(logging.WARNING):
        registry.register([LAYOUT], "engine-a")
        registry.register([OTHER], "engine-a")
    said = [r.message for r in caplog.records if "cannot write the layout registry" in r.message]
    assert len(said) == 1 and str(registry_path(missing)) in said[0]
    assert [layout.fingerprint for layout in registry.layouts()] == [LAYOUT, OTHER]
