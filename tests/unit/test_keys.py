"""Chunk keys: prefix chaining, layout and salt separation, stability across processes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import (
    KEY_BYTES,
    TOKEN_ID_MAX,
    ChunkKey,
    LayoutFingerprint,
    chunk_keys,
    fragment_key,
    max_hit_tokens,
)
from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Tier
from kvharbor.hal.ram import RamDevice

# Hypothesis' per-example deadline is a timing assert; a loaded CI machine must
# not fail a property that holds.
untimed = settings(deadline=None)

token_ids = st.lists(st.integers(0, TOKEN_ID_MAX), max_size=80)
chunk_sizes = st.integers(1, 9)
salts = st.none() | st.text(max_size=12)

LAYOUT = LayoutFingerprint(model_id="test/model", chunk_size=4)
DIGEST = LAYOUT.digest()


def keys_of(tokens: list[int], chunk_size: int, salt: str | None = None) -> list[ChunkKey]:
    return chunk_keys(DIGEST, chunk_size, tokens, salt=salt)


@untimed
@given(token_ids, chunk_sizes, salts)
def test_keys_are_16_bytes_one_per_full_chunk(tokens: list[int], chunk: int, salt: str | None) -> None:
    keys = keys_of(tokens, chunk, salt)
    assert len(keys) == len(tokens) // chunk
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)


@untimed
@given(token_ids, chunk_sizes, salts, st.data())
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(
    tokens: list[int], chunk: int, salt: str | None, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(tokens)), label="prefix length")
    assert keys_of(tokens[:cut], chunk, salt) == keys_of(tokens, chunk, salt)[: cut // chunk]


@untimed
@given(token_ids, chunk_sizes, salts, st.data())
def test_changing_a_token_changes_its_chunk_key_and_every_later_one_only(
    tokens: list[int], chunk: int, salt: str | None, data: st.DataObject
) -> None:
    full = len(tokens) // chunk
    assume(full >= 1)
    position = data.draw(st.integers(0, full * chunk - 1), label="changed position")
    new = data.draw(st.integers(0, TOKEN_ID_MAX).filter(lambda t: t != tokens[position]))
    changed = [*tokens[:position], new, *tokens[position + 1 :]]
    before, after = keys_of(tokens, chunk, salt), keys_of(changed, chunk, salt)
    j = position // chunk
    assert after[:j] == before[:j]
    assert all(a != b for a, b in zip(after[j:], before[j:], strict=True))


@untimed
@given(token_ids, chunk_sizes, salts, salts)
def test_different_salts_share_no_key(tokens: list[int], chunk: int, salt_a: str | None, salt_b: str | None) -> None:
    assume(salt_a != salt_b)
    assert not set(keys_of(tokens, chunk, salt_a)) & set(keys_of(tokens, chunk, salt_b))


def test_no_salt_and_empty_salt_are_different_salts() -> None:
    tokens = list(range(8))
    assert not set(keys_of(tokens, 4, None)) & set(keys_of(tokens, 4, ""))


@pytest.mark.parametrize("salt", [b"bytes-salt", 7, ["x"]])
def test_a_salt_that_is_not_a_string_is_refused(salt: Any) -> None:
    with pytest.raises(TypeError, match="cache_salt must be a string"):
        chunk_keys(DIGEST, 4, list(range(8)), salt=salt)
    with pytest.raises(TypeError):  # Also when the prompt is too short to get a key.
        chunk_keys(DIGEST, 4, [1], salt=salt)


@pytest.mark.parametrize("bad", [-1, TOKEN_ID_MAX + 1, 2**64])
@pytest.mark.parametrize("position", [0, 5, 9])  # 9: in the partial tail, still refused.
def test_a_token_id_out_of_range_is_refused_by_name_and_position(bad: int, position: int) -> None:
    tokens = list(range(10))
    tokens[position] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} at position {position} is outside"):
        chunk_keys(DIGEST, 4, tokens)


def test_a_token_that_is_not_an_integer_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"token id 1\.5 at position 2 is not an integer"):
        chunk_keys(DIGEST, 4, [1, 2, 1.5, 3])  # type: ignore[list-item]


# One changed value per field. A field added to LayoutFingerprint without an
# entry here fails `test_every_layout_field_separates_keys` until one is added.
_CHANGED_FIELD: dict[str, Any] = {
    "model_id": "test/other-model",
    "chunk_size": 5,
    "kv_dtype": "fp8_e4m3",
    "model_revision": "0123abcd",
    "kv_shapes": ("L0:2x8x4x64:bfloat16",),
    "tp_size": 4,  # The base is tp_size=2, tp_rank=1: both fields can change alone.
    "tp_rank": 0,
    "pp_rank": 1,
    "key_namespace": "tenant-b",
    "fragment_bytes": 2 * 1024 * 1024,
    "format_version": LAYOUT.format_version + 1,
    "extra": (("block_size", "32"),),
}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(LayoutFingerprint)])
def test_every_layout_field_separates_keys(name: str) -> None:
    base = LayoutFingerprint(model_id="test/model", chunk_size=4, tp_size=2, tp_rank=1)
    changed = dataclasses.replace(base, **{name: _CHANGED_FIELD[name]})
    assert changed != base
    tokens = list(range(200))
    keys_base = chunk_keys(base.digest(), base.chunk_size, tokens)
    keys_changed = chunk_keys(changed.digest(), changed.chunk_size, tokens)
    assert keys_base and keys_changed
    assert not set(keys_base) & set(keys_changed)


@untimed
@given(token_ids, chunk_sizes, st.integers(0, 3))
def test_a_hit_never_exceeds_the_full_chunk_bound(tokens: list[int], chunk: int, extra: int) -> None:
    # A store holding every chunk of a longer prompt still serves this one no
    # more than floor(n / c) * c tokens: the partial tail has no key to hit.
    tier = Tier(
        "ram",
        RamDevice("ram", 1 << 20),
        MemoryIndex(),
        1 << 20,
        CircuitBreaker(BreakerSettings()),
    )
    store = TieredStore([tier])
    longer = tokens + [7] * (extra * chunk + chunk)
    for key in keys_of(longer, chunk):
        store.put(key, DIGEST, b"kv")
    hit_tokens = store.lookup(keys_of(tokens, chunk), chunk_tokens=chunk) * chunk
    assert hit_tokens == max_hit_tokens(len(tokens), chunk) <= len(tokens)
    assert hit_tokens > len(tokens) - chunk


@pytest.mark.parametrize(
    ("n", "chunk", "bound"), [(0, 256, 0), (255, 256, 0), (256, 256, 256), (1000, 256, 768), (-5, 4, 0), (7, 1, 7)]
)
def test_max_hit_tokens(n: int, chunk: int, bound: int) -> None:
    assert max_hit_tokens(n, chunk) == bound


_SUBPROCESS_KEYS = """
from kvharbor.cache.keys import LayoutFingerprint, chunk_keys
fp = LayoutFingerprint(
    model_id="m", chunk_size=3, kv_shapes=("L0:a", "L1:b"),
    extra=(("z", "1"), ("a", "2")), key_namespace="ns",
)
print(fp.digest().hex())
for key in chunk_keys(fp.digest(), 3, list(range(100, 130)), salt="tenant"):
    print(key.hex())
"""


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVHARBOR")}
        env["PYTHONHASHSEED"] = seed
        result = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_KEYS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    lines = outputs.pop().split()
    layout = LayoutFingerprint(
        model_id="m",
        chunk_size=3,
        kv_shapes=("L0:a", "L1:b"),
        extra=(("a", "2"), ("z", "1")),
        key_namespace="ns",
    )
    expected = chunk_keys(layout.digest(), 3, list(range(100, 130)), salt="tenant")
    assert lines == [layout.digest().hex(), *(k.hex() for k in expected)]


# ---- golden vectors -------------------------------------------------------
# A stability contract: these bytes name objects already stored in users'
# caches (on disk, on NFS, on cards). If this test fails, the change makes
# every existing cache unreadable (silently: all misses). Such a change needs
# FORMAT_VERSION bumped (which changes the digests below on purpose) and a
# release note; never "fix" the test by pasting in new values alone. (Bumped to 2 with the
# page-aligned payload: CHANGELOG.)

GOLDEN_LAYOUT = LayoutFingerprint(
    model_id="meta-llama/Llama-3.1-8B-Instruct",
    chunk_size=4,
    kv_dtype="bfloat16",
    model_revision="0e9e39f249a16976918f6564b8830bc894c89659",
    kv_shapes=("L0:2x4x8x128:bfloat16", "L1:2x4x8x128:bfloat16"),
    tp_size=2,
    tp_rank=1,
    pp_rank=0,
    key_namespace="golden",
    fragment_bytes=2097152,
    extra=(("block_size", "16"),),
)
GOLDEN_TOKENS = [0, 1, 2, 3, 128000, 9906, 1917, TOKEN_ID_MAX, 7, 8]


def test_golden_layout_encoding_and_digest() -> None:
    assert GOLDEN_LAYOUT.canonical() == (
        b'{"encoding":1,"layout":{"chunk_size":4,"extra":[["block_size","16"]],'
        b'"format_version":3,"fragment_bytes":2097152,"key_namespace":"golden",'
        b'"kv_dtype":"bfloat16","kv_shapes":["L0:2x4x8x128:bfloat16","L1:2x4x8x128:bfloat16"],'
        b'"model_id":"meta-llama/Llama-3.1-8B-Instruct",'
        b'"model_revision":"0e9e39f249a16976918f6564b8830bc894c89659",'
        b'"pp_rank":0,"tp_rank":1,"tp_size":2}}'
    )
    assert GOLDEN_LAYOUT.digest().hex() == "de0896b3656ee5b7907cdf51582f895e"


@pytest.mark.parametrize(
    ("salt", "expected"),
    [
        (None, ["7cc2c38fe4ee52645e19f8989a7e117b", "a2857786bda19c7c8b33e9770a10f696"]),
        ("", ["4561bcb536ee3e4d4009f8fef49ac7f2", "c13942a61e9ee6def86799234033f467"]),
        ("tenant-a", ["3a8b82ae52991500e96acacbd8b9cb70", "b3f5df0b1f95467073134c3dcf7ab3f3"]),
    ],
)
def test_golden_chunk_keys(salt: str | None, expected: list[str]) -> None:
    keys = chunk_keys(GOLDEN_LAYOUT.digest(), 4, GOLDEN_TOKENS, salt=salt)
    assert [k.hex() for k in keys] == expected


def test_golden_chunk_keys_full_size_chunks_and_chain_continuation() -> None:
    layout = LayoutFingerprint(model_id="golden-model", chunk_size=256)
    assert layout.digest().hex() == "e150b0248d0d50a1f61ce566cede8b81"
    tokens = [(i * 2654435761) % 128256 for i in range(600)]
    keys = chunk_keys(layout.digest(), 256, tokens, salt="s")
    assert [k.hex() for k in keys] == [
        "4fe121fec032828691e46488f19e1ba7",
        "8e5c4e374c8bd835783e8539c343e9e3",
    ]
    continued = chunk_keys(layout.digest(), 256, tokens, salt="s", parent=bytes(range(16)))
    assert continued[0].hex() == "ebb5f20295d8507f093dd26a339eb124"


def test_golden_fragment_key() -> None:
    assert fragment_key(bytes(range(16)), 1).hex() == "d66fda8aa3af97d176a262c15b670ecb"


def test_engine_page_keys_are_stable_and_apart_per_layout_and_hash() -> None:
    from kvharbor.cache.keys import engine_page_key

    a = LayoutFingerprint(model_id="m", chunk_size=16).digest()
    b = LayoutFingerprint(model_id="m", chunk_size=32).digest()
    page = bytes(range(32))
    assert engine_page_key(a, page) == engine_page_key(a, bytes(page))
    assert len({engine_page_key(a, page), engine_page_key(b, page), engine_page_key(a, page[:-1] + b"x")}) == 3
    # Its own hash domain: the same input bytes as a token chunk give another key.
    assert engine_page_key(a, page) not in chunk_keys(a, 8, list(range(8)))
    with pytest.raises(ValueError, match="empty"):
        engine_page_key(a, b"")
