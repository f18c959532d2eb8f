"""Purge without a gateway: the namespace tag in object headers, the filter and its bad
input, the PURGE message, the age rule across tiers, and ``kvharbor purge`` on the
persistent tiers of a config whose gateway is not running (real files, real manifest)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from kvharbor.cache import index as index_module
from kvharbor.cache.assembly import open_store, open_tier
from kvharbor.cache.format import CorruptObject, encode, parse_header
from kvharbor.cache.keys import NAMESPACE_UNKNOWN, LayoutFingerprint, namespace_tag, short_digest
from kvharbor.cache.purge import STEP_KEYS, PurgeFilter, PurgeReport, TierPurge, parse_duration, purge
from kvharbor.cache.store import TieredStore
from kvharbor.cli import main
from kvharbor.config import load_config
from kvharbor.gateway import protocol as p

SETTLE_S = 30.0
"""Longest wait for the file tier's write queue to write what the puts gave it."""
ALPHA = LayoutFingerprint(model_id="m", chunk_size=16, key_namespace="alpha")
BETA = LayoutFingerprint(model_id="m", chunk_size=16, key_namespace="beta")
VALUE = os.urandom(2048)


# -- the header ----------------------------------------------------------------


def test_the_header_records_the_namespace_tag_under_its_checksum() -> None:
    (part,) = encode(bytes(16), ALPHA.digest(), VALUE, namespace=namespace_tag("alpha"))
    assert parse_header(part.header).namespace == namespace_tag("alpha") != namespace_tag("beta")
    damaged = bytearray(part.header)
    damaged[-12] ^= 1  # A byte of the tag: covered by the header checksum.
    with pytest.raises(CorruptObject, match="header checksum"):
        parse_header(bytes(damaged))


def test_an_object_written_without_a_tag_reads_as_namespace_unknown() -> None:
    # What a release before tags wrote: those 8 bytes were zero padding.
    (part,) = encode(bytes(16), ALPHA.digest(), VALUE)
    assert parse_header(part.header).namespace == NAMESPACE_UNKNOWN
    assert namespace_tag("") != NAMESPACE_UNKNOWN


# -- the filter and its bad input ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"), [("30m", 1800), ("2h", 7200), ("7d", 604800), ("1h30m", 5400), ("90s", 90)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2", "2 hours", "h", "-1h", "0m", "1y", "1h 30m"])
def test_a_bad_duration_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"--older-than .*(expected a number and a unit|longer than 0)"):
        parse_duration(text)


@pytest.mark.parametrize("layout", ["xyz", "abc", "#12345", "a" * 33])
def test_a_bad_layout_id_is_refused(layout: str) -> None:
    with pytest.raises(ValueError, match="is not a layout ID"):
        PurgeFilter.parse_layout(layout)


def test_a_filter_names_exactly_one_selection() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        PurgeFilter()
    with pytest.raises(ValueError, match="exactly one"):
        PurgeFilter(namespace="a", older_than_s=1)


def test_purge_messages_round_trip_and_a_bad_body_is_malformed() -> None:
    request = p.Purge(PurgeFilter.parse_layout("#ABCDEF123456"), apply=True)
    _, decoded = p.decode(p.encode(request, 7))
    assert decoded == request
    answer = p.Purged(PurgeReport(request.selection, True, (TierPurge("ram", 2, 9000),), "gateway pid 1"))
    assert p.decode(p.encode(answer, 8))[1] == answer
    for body in (b'{"namespace": "a", "layout": "abcdef"}', b"not json", b'{"older_than_s": -1}'):
        frame = p.FRAME.pack(8 + len(body), p.MessageType.PURGE, 0, 1) + p._U32.pack(1) + p._U32.pack(len(body)) + body
        with pytest.raises(p.ProtocolError) as raised:
            p.decode(frame)
        assert raised.value.code is p.ErrorCode.MALFORMED


# -- the age rule across tiers ----------------------------------------------------


def two_tier_store(tmp_path: Path, **file_tier: object) -> TieredStore:
    config = load_config(write_config(tmp_path, **file_tier), environ={})
    return open_store(config)


def write_config(tmp_path: Path, **file_tier: object) -> Path:
    document = {
        "gateway": {"mode": "service", "socket": str(tmp_path / "gw.sock")},
        "storage": {
            "tiers": [
                {"name": "ram", "type": "ram", "capacity_gb": 0.01},
                {"name": "local", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 0.01, **file_tier},
            ]
        },
    }
    path = tmp_path / "kvharbor.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_value_used_recently_in_one_tier_is_not_old_in_any(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = two_tier_store(tmp_path)
    try:
        keys = [bytes([i]) * 16 for i in range(4)]
        for key in keys:
            assert store.put(key, ALPHA.digest(), VALUE)
        assert store.settle(SETTLE_S)  # The file tier is written from its queue; a purge reads the tiers.
        now_s = time.time()
        # The RAM tier uses keys[0] 100 s from now; the file tier is not asked for it again.
        monkeypatch.setattr(index_module, "_now_s", lambda: int(now_s) + 100)
        store.tiers[0].touch([keys[0]])
        later_ns = int((now_s + 120) * 1e9)
        report = purge(store.tiers, PurgeFilter(older_than_s=60), True, "test", now_ns=later_ns)
        assert [(t.tier, t.objects) for t in report.tiers] == [("ram", 3), ("local", 3)]
        assert store.contains(keys) == [True, False, False, False]
        assert store.tiers[1].contains(keys[:1]) == [True]
    finally:
        store.close()


# -- kvharbor purge with no gateway running ----------------------------------------


def test_no_gateway_purges_the_files_directly_and_keeps_objects_of_unknown_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    store = open_store(load_config(config_path, environ={}))
    alpha = [bytes([1, i]) * 8 for i in range(3)]
    untagged = [bytes([2, i]) * 8 for i in range(2)]
    try:
        for key in untagged:  # No writer said its namespace: stored as before tags.
            assert store.put(key, ALPHA.digest(), VALUE)
        assert store.settle(SETTLE_S)  # On the disk before the namespace is known.
        store.namespaces.learn(ALPHA.digest(), namespace_tag("alpha"))
        for key in alpha:
            assert store.put(key, ALPHA.digest(), VALUE)
    finally:
        store.close()

    def run(*args: str) -> int:
        return main(["purge", *args, "--config", str(config_path)])

    assert run("--namespace", "alpha") == 0
    out = capsys.readouterr().out
    assert "no gateway answers at" in out
    assert "tier local: would remove 3 values" in out
    assert "tier local: 2 values record no namespace" in out
    assert "tier 'ram' lives in a gateway's memory only" in out
    assert run("--namespace", "alpha", "--yes", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["applied"] and report["tiers"] == [
        {"tier": "local", "objects": 3, "nbytes": report["tiers"][0]["nbytes"], "namespace_unknown": 2, "error": ""}
    ]
    reopened = open_store(load_config(config_path, environ={}))
    try:
        local = reopened.tiers[1]
        assert local.contains(alpha) == [False] * 3
        assert local.contains(untagged) == [True] * 2
        # The same objects by layout: the untagged ones carry their fingerprint like any other.
        report_layout = purge(reopened.tiers, PurgeFilter.parse_layout(short_digest(ALPHA.digest())), True, "test")
        assert [t.objects for t in report_layout.tiers] == [0, 2]
        assert local.contains(untagged) == [False] * 2
    finally:
        reopened.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "2 hours"], "is not a duration"),
        (["--layout", "nothex"], "is not a layout ID"),
        (["--namespace", ""], "--namespace needs a name"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["purge", *args, "--yes", "--config", str(write_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvharbor: error: ") and message in err and "Traceback" not in err


# -- a card tier -------------------------------------------------------------------


def card_config_file(tmp_path: Path) -> Path:
    document = {
        "gateway": {"mode": "service", "socket": str(tmp_path / "gw.sock")},
        "storage": {
            "tiers": [
                {"name": "local", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 0.01},
                {"name": "card", "type": "nvme", "device": f"file:{tmp_path / 'card.img'}", "capacity_gb": 16 / 1024},
            ]
        },
        "card": {"region_mb": 4, "fragment_bytes": 1 << 20},
    }
    path = tmp_path / "kvharbor.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_card_tier_is_purged_by_its_header_tags_or_by_the_same_key_elsewhere_and_skipped_while_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = card_config_file(tmp_path)
    config = load_config(config_path, environ={})
    alpha = [bytes([1, i]) * 8 for i in range(3)]
    beta = [bytes([2, i]) * 8 for i in range(2)]
    store = open_store(config)
    try:
        for fingerprint, keys in ((ALPHA, alpha), (BETA, beta)):
            store.namespaces.learn(fingerprint.digest(), namespace_tag(fingerprint.key_namespace))
            for key in keys:
                assert store.put(key, fingerprint.digest(), VALUE)
        store.tiers[0].delete(beta)  # Beta only on the card now.
    finally:
        store.close()

    def run(*args: str) -> dict[str, int]:
        assert main(["purge", *args, "--yes", "--json", "--config", str(config_path)]) == 0
        return {t["tier"]: t["objects"] for t in json.loads(capsys.readouterr().out)["tiers"]}

    # The card stores under fingerprints of its own, which a new process cannot map back to
    # the engine's: its alpha objects go because the file tier's match the layout.
    assert run("--layout", short_digest(ALPHA.digest())) == {"local": 3, "card": 3}
    # Its headers record the namespace: beta is found on the card alone.
    assert run("--namespace", "beta") == {"local": 0, "card": 2}

    holder = open_tier(config.storage.tiers[1], config)  # What a serving gateway does: the card's lock.
    try:
        assert main(["purge", "--older-than", "1s", "--yes", "--config", str(config_path)]) == 1
        out = capsys.readouterr().out
        assert "tier card: not searched:" in out and "a gateway holds it; left as it is" in out
        assert "tier local: removed 0 values" in out
    finally:
        holder.close()


def test_a_long_purge_reports_progress_every_few_hundred_keys(tmp_path: Path) -> None:
    # What keeps a client's request_timeout_ms from firing while the gateway purges. The file
    # tier written at once: its queue would drop the puts that outrun it, as it should.
    store = two_tier_store(tmp_path, async_writes=False)
    try:
        keys = [i.to_bytes(16, "little") for i in range(3 * STEP_KEYS)]
        for key in keys:
            assert store.put(key, ALPHA.digest(), b"v")
        steps: list[int] = []
        report = purge(
            store.tiers, PurgeFilter.parse_layout(short_digest(ALPHA.digest())), True, "test", progress=steps.append
        )
        assert report.objects == 2 * len(keys) and store.contains(keys) == [False] * len(keys)
        assert steps == list(range(1, len(steps) + 1))
        # Per tier: its index read, a step per STEP_KEYS headers read, one per batch removed.
        assert len(steps) >= 2 * (1 + 3 + 3)
    finally:
        store.close()
