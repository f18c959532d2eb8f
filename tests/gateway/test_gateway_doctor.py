"""``kvharbor doctor`` against a real gateway process, run as a subprocess: where a prompt's
chunks are, under which layout, and each cause of a miss it names; bad prompt files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from gateway_harness import Lab, closing_client
from ops_harness import LAYOUT, kvharbor_cmd, store_prompt, two_tier_config

from kvharbor.gateway.client import GatewayClient

OTHER = dataclasses.replace(LAYOUT, kv_dtype="fp8_e4m3")
"""Another engine's layout: the same model and chunk size, another KV cache dtype."""
STORED = list(range(1000, 1800))
"""Stored under `LAYOUT`: three full chunks and a tail."""
ELSEWHERE = list(range(5000, 5600))
"""Stored under `OTHER` only: two full chunks."""


def prompt_file(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def served(lab: Lab) -> tuple[Lab, Path]:
    """A gateway whose tiers hold `STORED` under `LAYOUT` and `ELSEWHERE` under `OTHER`;
    `LAYOUT`'s engine registered last, so it is the layout the config's settings pick."""
    config = two_tier_config(lab)
    gateway = lab.gateway(config).start()
    section = gateway.config.gateway
    with closing_client(GatewayClient.connect(section, "engine-fp8", layouts=[OTHER])) as old:
        assert store_prompt(old, ELSEWHERE, OTHER) == 2
    with closing_client(GatewayClient.connect(section, "engine-a", layouts=[LAYOUT])) as engine:
        assert store_prompt(engine, STORED) == 3
    return lab, config


def test_doctor_finds_each_chunk_and_names_the_layout_field_that_differs(served: tuple[Lab, Path]) -> None:
    lab, config = served
    stored = prompt_file(lab.tmp_path, "stored.json", json.dumps(STORED))
    found = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored)
    assert found.returncode == 0, found.stdout + found.stderr
    assert "chunks 0-2 (tokens 0-767): ram, files" in found.stdout
    assert "ok       chunks: all 3 chunk(s) are stored" in found.stdout
    assert "a partial tail of 32 tokens that is never stored" in found.stdout
    assert "ok       engine: 2 layout(s) registered with this gateway since it started" in found.stdout
    report = json.loads(kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored, "--json").stdout)
    assert report["layout"]["digest"] == LAYOUT.digest().hex() and report["tokens"] == len(STORED)
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["ram", "files"]] * 3

    elsewhere = prompt_file(lab.tmp_path, "elsewhere.txt", " ".join(map(str, ELSEWHERE)))
    moved = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", elsewhere)
    assert moved.returncode == 1
    assert "chunks 0-1 (tokens 0-511): not stored" in moved.stdout
    assert (
        f"problem  other_layouts: 2 of 2 chunk(s) of this prompt are stored under layout {OTHER.short()}, which "
        "differs from the layout checked in: kv_dtype ('auto' here, 'fp8_e4m3' there)"
    ) in moved.stdout
    picked = kvharbor_cmd(
        "doctor", "--config", str(config), "--prompt-file", elsewhere, "--layout", OTHER.digest().hex()[:10]
    )
    assert picked.returncode == 0 and "ok       chunks: all 2 chunk(s) are stored" in picked.stdout
    unknown = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", elsewhere, "--layout", "beef")
    assert unknown.returncode == 2 and "kvharbor: error: --layout beef names no registered layout" in unknown.stderr


def test_doctor_names_a_short_prompt_a_salt_and_the_engine_log(served: tuple[Lab, Path]) -> None:
    lab, config = served
    short = prompt_file(lab.tmp_path, "short.txt", "1 2 3 4 5 6 7 8 9 10")
    result = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", short)
    assert result.returncode == 1
    assert "problem  prompt: the prompt has 10 tokens, shorter than a chunk (256 tokens)" in result.stdout

    stored = prompt_file(lab.tmp_path, "stored.json", json.dumps(STORED))
    salted = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored, "--salt", "tenant-a")
    assert salted.returncode == 1 and "chunks 0-2 (tokens 0-767): not stored" in salted.stdout
    assert "problem  salt: 3 of 3 chunk(s) are stored without a cache_salt" in salted.stdout

    document = yaml.safe_load(config.read_text())
    document["engine"] = {"require_cache_salt": True}
    strict = config.with_name("strict.yaml")
    strict.write_text(yaml.safe_dump(document))
    unsalted = kvharbor_cmd("doctor", "--config", str(strict), "--prompt-file", stored)
    assert unsalted.returncode == 1
    assert "problem  salt: engine.require_cache_salt is on and this prompt has no cache_salt" in unsalted.stdout

    log = lab.tmp_path / "engine.log"
    log.write_text(
        "INFO starting\n(VllmWorker pid=1) INFO kvharbor: 2 cache tensors registered (rank 0, page 4096 B)\n"
    )
    seen = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored, "--engine-log", str(log))
    assert seen.returncode == 0 and "ok       engine_log:" in seen.stdout and "(ranks [0])" in seen.stdout
    with log.open("a") as file:
        file.write(
            "ERROR kvharbor: external KV cache turned off on this rank: gateway unavailable: no socket. "
            "The engine keeps serving without it; restart the engine\n"
        )
    off = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored, "--engine-log", str(log))
    assert off.returncode == 1 and "then turned the external cache off: gateway unavailable: no socket;" in off.stdout
    with log.open("a") as file:
        file.write("(VllmWorker pid=2) INFO kvharbor: 2 cache tensors registered (rank 0, page 4096 B)\n")
    again = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored, "--engine-log", str(log))
    assert again.returncode == 0, "an engine started again after the off line registered: on again"
    log.write_text("INFO starting\nINFO no connector here\n")
    unseen = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored, "--engine-log", str(log))
    assert unseen.returncode == 1 and "has no 'kvharbor: N cache tensors registered' line" in unseen.stdout


def test_with_no_gateway_doctor_finds_the_chunks_in_the_file_tier(served: tuple[Lab, Path]) -> None:
    lab, config = served
    (gateway,) = lab.gateways
    assert gateway.stop() == 0
    stored = prompt_file(lab.tmp_path, "stored.json", json.dumps(STORED))
    result = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", stored)
    assert result.returncode == 1, "no gateway answers: that alone is a problem"
    assert "problem  gateway: socket missing:" in result.stdout
    assert "chunks 0-2 (tokens 0-767): files" in result.stdout
    assert f"keys for layout {LAYOUT.short()}" in result.stdout


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hello world", "token 'hello' at position 0 is not an integer"),
        ('[1, 2, "three"]', "element 2 ('three') is not a token id"),
        ('{"tokens": [1]}', "is a JSON dict, not a list of token ids"),
        ("[1, 2", "starts like JSON but is not a JSON list"),
        ("", "is empty: give token ids"),
        ("1 2 -3", "token id -3 at position 2 is outside 0..4294967295"),
    ],
)
def test_a_prompt_file_that_is_not_token_ids_is_a_clear_error(tmp_path: Path, text: str, says: str) -> None:
    """No gateway is needed to refuse bad input; the token range is checked by the key function."""
    path = prompt_file(tmp_path, "prompt.txt", text)
    result = kvharbor_cmd("doctor", "--prompt-file", path)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith("kvharbor: error: ") and says in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_tokenizes_text_with_the_models_tokenizer(served: tuple[Lab, Path], tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    lab, config = served
    text = "user : tell me about the weather " * 60
    ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(text)
    (gateway,) = lab.gateways
    with closing_client(GatewayClient.connect(gateway.config.gateway, "engine-a", layouts=[LAYOUT])) as engine:
        assert store_prompt(engine, ids) == len(ids) // 256 >= 1
    result = kvharbor_cmd("doctor", "--config", str(config), "--prompt", text, "--model", str(tiny_model), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["tokens"] == len(ids) and all(chunk["tiers"] == ["ram", "files"] for chunk in report["chunks"])
    no_model = kvharbor_cmd("doctor", "--config", str(config), "--prompt", text)
    assert no_model.returncode == 2 and "--prompt TEXT needs --model DIR" in no_model.stderr
