"""``kvharbor card wipe`` through `kvharbor.cli.main`: confirmation, the lock of a card in
use, --force, and the drivers' own wipes (block store, simulated card, KV namespace)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from test_nvme_card import card as kv_card

from kvharbor.cli import main
from kvharbor.config import MIB
from kvharbor.hal.block.store import BlockStoreDevice

REGION_BYTES = 1 * MIB


def block_card(path: Path, values: int) -> BlockStoreDevice:
    store = BlockStoreDevice(
        "card", str(path), 64 * 1024, region_bytes=REGION_BYTES, create_bytes=4096 + 4 * REGION_BYTES
    )
    for i in range(values):
        store.put(bytes([i]) * 16, [os.urandom(1000)])
    return store


def keys_on(path: Path) -> int:
    store = BlockStoreDevice("card", str(path), 64 * 1024, region_bytes=REGION_BYTES)
    try:
        return store.usage().keys
    finally:
        store.close()


def wipe(path: Path, *flags: str) -> int:
    # region_mb 1 with fragments of 64 KiB: the geometry the store was made with.
    config = path.parent / "kvharbor.yaml"
    config.write_text(
        f"storage: {{tiers: [{{name: card, type: nvme, device: 'file:{path}'}}]}}\n"
        "card: {region_mb: 1, fragment_bytes: 65536}\n"
    )
    return main(["card", "wipe", "--config", str(config), *flags])


@pytest.fixture
def card_path(tmp_path: Path) -> Path:
    path = tmp_path / "card.img"
    block_card(path, 5).close()
    return path


def test_wipe_with_yes_removes_every_key_and_says_how_many(card_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert wipe(card_path, "--yes", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"wiped": f"file:{card_path}", "keys_removed": 5}
    assert keys_on(card_path) == 0


def test_wipe_asks_and_only_yes_wipes(
    card_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("no\n"))
    assert wipe(card_path) == 1
    captured = capsys.readouterr()
    assert "remove all of its 5 keys? type 'yes'" in captured.out and "not wiped" in captured.err
    assert keys_on(card_path) == 5
    monkeypatch.setattr("sys.stdin", io.StringIO("yes\n"))
    assert wipe(card_path) == 0 and keys_on(card_path) == 0


def test_wipe_without_an_answer_on_stdin_refuses_naming_yes(
    card_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert wipe(card_path) == 2
    assert "wipe needs a confirmation and stdin gives none; pass --yes" in capsys.readouterr().err
    assert keys_on(card_path) == 5


def test_a_card_in_use_is_refused_unless_forced_and_its_holder_never_reads_wrong_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "card.img"
    holder = block_card(path, 3)  # Holds the store's lock, as a serving gateway does.
    try:
        assert wipe(path, "--yes") == 2
        err = capsys.readouterr().err
        assert "is in use by another process: a gateway is serving it" in err and "--force" in err
        assert wipe(path, "--yes", "--force", "--json") == 0
        assert json.loads(capsys.readouterr().out)["keys_removed"] == 3
        into = memoryview(bytearray(2000))
        assert holder.get(bytes([0]) * 16, into) == 1000  # Its own value, whole, until it restarts.
    finally:
        holder.close()
    assert keys_on(path) == 0  # Reopened: the wipe took.


def test_the_simulated_cards_wipe_and_flags_outside_wipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["card", "wipe", "--device", "sim", "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"wiped": "sim", "keys_removed": 0}
    assert main(["card", "status", "--device", "sim", "--yes"]) == 2
    assert "--yes and --force apply to 'kvharbor card wipe' only" in capsys.readouterr().err


def test_a_missing_card_file_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["card", "wipe", "--device", f"file:{tmp_path / 'none.img'}", "--yes"]) == 2
    assert "none.img does not exist" in capsys.readouterr().err


def test_a_kv_namespace_wipe_deletes_every_listed_key(tmp_path: Path) -> None:
    device = kv_card(tmp_path, "smart_log_v2.7.jsonc")
    for i in range(7):
        device.put(bytes([i + 1]) * 16, [b"v" * 100])
    assert device.wipe() == 7
    assert list(device.scan()) == []
