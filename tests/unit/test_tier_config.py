"""Mistakes in a file, nfs or ontap tier's section, and the local fallback tier.

A wrong key or value is refused when the config loads, naming the tier and the
key; a missing required key or a path that is not what the tier needs skips
that tier at start (``tier <name> unavailable: ...``) while the rest of the
cache keeps working. With no persistent tier open, writes go to the fallback
directory (``storage.fallback_path``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache.assembly import open_store
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.config import ConfigError, IncompleteTierSection, default_fallback_dir, validate_config

FINGERPRINT = LayoutFingerprint("m", 16).digest()
RAM = {"name": "ram", "type": "ram", "capacity_gb": 0.01}
FALLBACK_SAID = "kvharbor: no persistent tier available ({why}); writing KV to local fallback {path} (0.01 GiB"


def config(tmp_path: Path, *tiers: dict[str, Any], **storage: Any) -> dict[str, Any]:
    return {
        "storage": {
            "tiers": list(tiers),
            "fallback_path": str(tmp_path / "fallback"),
            "fallback_capacity_gb": 0.01,
            **storage,
        }
    }


@pytest.mark.parametrize(
    ("tier", "named"),
    [
        ({"type": "file", "path": "/x", "fsync": "maybe"}, "tiers[0] (t): fsync: Input should be a valid boolean"),
        ({"type": "file", "path": "/x", "paht": "/y"}, "tiers[0] (t): paht: Extra inputs are not permitted"),
        ({"type": "nfs", "path": "/x", "mount": "/x"}, "tiers[0] (t): mount: Extra inputs are not permitted"),
        ({"type": "nfs", "path": 7}, "tiers[0] (t): path: Input should be a valid string"),
        ({"type": "nfs", "path": "/x", "fanout_levels": 9}, "tiers[0] (t): fanout_levels: Input should be less"),
        ({"type": "ontap", "mount": "/m", "protocol": "rdma"}, "tiers[0] (t): protocol: Input should be 'nfs' or"),
        ({"type": "ontap", "mount": "/m", "strict_protocol": "x"}, "tiers[0] (t): strict_protocol: Input should be"),
        ({"type": "ontap", "mount": "/m", "path": "/elsewhere"}, "path: '/elsewhere' is not a directory on mount"),
        ({"type": "ontap", "mount": "/m", "path": "/m/../etc"}, "path: '/m/../etc' is not a directory on mount"),
        ({"type": "ontap", "mount": "m"}, "tiers[0] (t): mount: 'm' is not an absolute path"),
        ({"type": "ontap", "mount": "/m", "capacity_gb": 0}, "tiers[0] (t): capacity_gb: Input should be greater"),
    ],
)
def test_a_wrong_key_or_value_is_refused_naming_the_tier_and_key(tier: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=r"storage\.tiers") as refused:
        validate_config({"storage": {"tiers": [{"name": "t", "capacity_gb": 1, **tier}]}})
    assert named in str(refused.value)


@pytest.mark.parametrize(
    ("tier", "reason"),
    [
        ({"type": "file"}, "tier 't' (type file) requires 'path'"),
        ({"type": "nfs"}, "tier 't' (type nfs) requires 'path'"),
        ({"type": "ontap", "path": "/m/kv"}, "tier 't' (type ontap) requires 'mount'"),
        ({"type": "nvme"}, "tier 't' (type nvme) requires 'device'"),
    ],
)
def test_a_missing_required_key_skips_the_tier_naming_it(
    tmp_path: Path, tier: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = validate_config(config(tmp_path, RAM, {"name": "t", "capacity_gb": 1, **tier}))
    assert isinstance(loaded.storage.tiers[1], IncompleteTierSection)
    with caplog.at_level(logging.WARNING):
        store = open_store(loaded)
    try:
        assert f"kvharbor: tier t unavailable: {reason}; skipping" in caplog.text
        assert store.skipped == {"t": f"unavailable: {reason}"}
        key, value = os.urandom(16), os.urandom(5000)
        assert store.put(key, FINGERPRINT, value)
        assert bytes(store.get(key, FINGERPRINT) or b"") == value  # The rest of the cache works.
    finally:
        store.close()


def test_a_section_missing_both_path_and_capacity_names_both(tmp_path: Path) -> None:
    loaded = validate_config(config(tmp_path, {"name": "t", "type": "file"}))
    section = loaded.storage.tiers[0]
    assert isinstance(section, IncompleteTierSection)
    assert section.reason == "tier 't' (type file) requires 'capacity_gb' and 'path'"


@pytest.mark.parametrize(
    ("tier", "named"),
    [
        ({"type": "file"}, "tiers[0] (?): name: Field required"),  # A nameless tier cannot be reported.
        ({"type": "file", "name": "t", "fsync": 3}, "fsync: Input should be a valid boolean"),  # Missing and wrong.
    ],
)
def test_a_missing_key_beside_another_mistake_is_refused(tier: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        validate_config({"storage": {"tiers": [tier]}})
    assert named in str(refused.value)


def test_a_ram_only_cache_writes_to_the_fallback_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        store = open_store(validate_config(config(tmp_path, RAM)))
    try:
        assert [(t.name, t.device_type, t.fallback) for t in store.tiers] == [
            ("ram", "ram", False),
            ("fallback", "file", True),
        ]
        assert FALLBACK_SAID.format(why="none configured", path=tmp_path / "fallback") in caplog.text
        key, value = os.urandom(16), os.urandom(5000)
        assert store.put(key, FINGERPRINT, value)
        assert list((tmp_path / "fallback").glob("*/*/*")), "written through to the fallback directory"
        assert [t.fallback for t in store.status().tiers] == [False, True]
    finally:
        store.close()


def test_when_every_persistent_tier_is_skipped_the_fallback_names_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    tiers = [
        {"name": "disk", "type": "file", "path": str(tmp_path / "a-file"), "capacity_gb": 1},
        {"name": "filer", "type": "nfs", "path": str(tmp_path), "capacity_gb": 1},
    ]
    with caplog.at_level(logging.WARNING):
        store = open_store(validate_config(config(tmp_path, *tiers)))
    try:
        assert [t.name for t in store.tiers] == ["fallback"]
        assert FALLBACK_SAID.format(why="skipped: disk, filer", path=tmp_path / "fallback") in caplog.text
        # Objects there outlive the store: a second store finds them.
        key, value = os.urandom(16), os.urandom(5000)
        assert store.put(key, FINGERPRINT, value)
    finally:
        store.close()
    again = open_store(validate_config(config(tmp_path, *tiers)))
    try:
        assert bytes(again.get(key, FINGERPRINT) or b"") == value
    finally:
        again.close()


def test_no_fallback_while_a_persistent_tier_is_open(tmp_path: Path) -> None:
    disk = {"name": "disk", "type": "file", "path": str(tmp_path / "disk"), "capacity_gb": 0.01}
    store = open_store(validate_config(config(tmp_path, RAM, disk)))
    store.close()
    assert [t.name for t in store.tiers] == ["ram", "disk"] and not (tmp_path / "fallback").exists()


def test_fallback_path_null_keeps_a_ram_only_cache(tmp_path: Path) -> None:
    store = open_store(validate_config(config(tmp_path, RAM, fallback_path=None)))
    store.close()
    assert [t.name for t in store.tiers] == ["ram"] and not (tmp_path / "fallback").exists()


def test_a_fallback_that_does_not_open_is_said_and_ram_serves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "fallback").write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING):
        store = open_store(validate_config(config(tmp_path, RAM)))
    try:
        assert [t.name for t in store.tiers] == ["ram"]
        assert "and the local fallback" in caplog.text and "does not open either" in caplog.text
        key, value = os.urandom(16), os.urandom(5000)
        assert store.put(key, FINGERPRINT, value) and bytes(store.get(key, FINGERPRINT) or b"") == value
    finally:
        store.close()


@pytest.mark.parametrize(
    ("storage", "named"),
    [
        ({"fallback_capacity_gb": 0}, "storage.fallback_capacity_gb: Input should be greater than 0"),
        ({"fallback_capacity_gb": "lots"}, "storage.fallback_capacity_gb: Input should be a valid number"),
        ({"fallback_path": ""}, "storage.fallback_path: String should have at least 1 character"),
        ({"fallback_path": 5}, "storage.fallback_path: Input should be a valid string"),
        ({"tiers": [{**RAM, "name": "fallback"}]}, "tier name 'fallback' is the fallback tier's"),
    ],
)
def test_bad_fallback_settings_are_refused_naming_the_key(storage: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        validate_config({"storage": {"tiers": [RAM], **storage}})
    assert named in str(refused.value)


def test_a_tier_named_fallback_is_allowed_without_a_fallback() -> None:
    loaded = validate_config({"storage": {"tiers": [{**RAM, "name": "fallback"}], "fallback_path": None}})
    assert loaded.storage.tiers[0].name == "fallback"


def test_the_default_fallback_is_beside_the_default_cache_not_in_it() -> None:
    loaded = validate_config({})
    assert loaded.storage.fallback_path == str(default_fallback_dir())
    assert default_fallback_dir().name == "kvharbor-fallback" and loaded.storage.fallback_capacity_gb == 10
