"""Chunk keys: what names a stored chunk of KV cache.

A key must be *stable by construction*: the same tokens, layout and salt give
the same key in any process, on any host, under any PYTHONHASHSEED, Python or
engine version; a different layout or salt never shares a key. So keys are
computed here from explicit bytes only — never from ``hash()`` and never from
an engine's own block hashes, which change between engine releases.

Why BLAKE2b-128: it is in the standard library (no dependency, the same bytes
everywhere), it is a cryptographic hash, so two tenants cannot craft prompts
whose keys collide (a collision would serve one tenant's KV to another, i.e. a
wrong byte), and it runs at ~1 GB/s on one core, i.e. >200 M tokens/s of uint32
token ids. 128 bits leave a birthday bound near 2**64 keys: far beyond any
cache. Non-cryptographic 128-bit hashes (xxh3-128) are faster but offer no
resistance to crafted collisions.
"""

from __future__ import annotations

import array
import json
import operator
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from hashlib import blake2b
from typing import NewType

KEY_BYTES = 16
"""Every key — chunk keys, fragment keys, fingerprint digests — is 16 bytes."""

FORMAT_VERSION = 3
"""Version of the stored object format (header layout, checksum, fragmenting);
`kvharbor.cache.format` describes each.

Part of every fingerprint: a release that changes how bytes are stored gets
new keys, so it can never read an object written in the old format, and two
releases sharing a tier never write the same key (each one's objects are the
other's misses). 2: the header padded to a page, the payload page-aligned.
3: the payload checksum combined from 1 MiB segments' digests (`kvharbor.hal.checksum`).
"""

FINGERPRINT_ENCODING_VERSION = 1
"""Version of the canonical fingerprint encoding below."""

ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes naming one full chunk of one layout; see `chunk_keys`."""

_ROOT_PARENT = bytes(KEY_BYTES)
# Personalisations separate the hash domains: a chunk key can never equal a
# fingerprint digest or a fragment key, whatever the input bytes.
_PERSON_CHUNK = b"kvharbor.chunk1"
_PERSON_LAYOUT = b"kvharbor.layout1"
_PERSON_FRAGMENT = b"kvharbor.frag1"
_PERSON_TIER_LAYOUT = b"kvharbor.tier1"
_PERSON_NAMESPACE = b"kvharbor.ns1"
_PERSON_ENGINE_PAGE = b"kvharbor.page1"

TOKEN_ID_MAX = 2**32 - 1
"""Token ids are hashed as little-endian uint32; larger ids are refused."""


def key_hex(key: bytes) -> str:
    """The 32-character lower-case hex form used in logs, file names and the CLI."""
    return key.hex()


def check_key(key: bytes) -> None:
    """Raise ValueError unless ``key`` is exactly `KEY_BYTES` bytes."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"a key is {KEY_BYTES} bytes, got {size}")


def fragment_key(key: bytes, index: int) -> ChunkKey:
    """The key under which fragment ``index`` (>= 1) of ``key``'s value is stored.

    Fragment 0 lives under the key itself so that `lookup` needs one probe per
    chunk whatever the fragment count.
    """
    assert index >= 1, index
    check_key(key)
    digest = blake2b(key + index.to_bytes(4, "little"), digest_size=KEY_BYTES, person=_PERSON_FRAGMENT).digest()
    return ChunkKey(digest)


@dataclass(frozen=True, slots=True)
class LayoutFingerprint:
    """Everything that changes the bytes of a stored chunk.

    Two processes share a cache entry only if every field is equal. Adding a
    field is safe (it changes every digest: the cache refills, nothing wrong is
    read); dropping one is not, so fields are only ever added.
    """

    model_id: str
    chunk_size: int
    kv_dtype: str = "auto"
    model_revision: str = ""
    """A revision, commit or weights digest; empty when unknown."""
    kv_shapes: tuple[str, ...] = ()
    """One descriptor per registered KV tensor, e.g. ``"L0:2x128x256:float32"``."""
    tp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    key_namespace: str = "default"
    fragment_bytes: int = 0
    """The device fragment size in bytes; 0 when values are never split. Engines leave it
    0: a card tier folds its own fragment size into the fingerprints of what it stores
    (`tier_fingerprint`), so that a RAM or file hit survives a change of the card's."""
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = field(default=())
    """Engine-specific fields (e.g. block size) as sorted (name, value) pairs."""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {self.chunk_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.pp_rank < 0 or self.fragment_bytes < 0:
            raise ValueError("pp_rank and fragment_bytes must be >= 0")

    def canonical(self) -> bytes:
        """The canonical, versioned encoding that `digest` hashes.

        Sorted-key compact JSON of plain strings and integers: identical bytes on
        every platform and Python version.
        """
        fields = asdict(self)
        fields["kv_shapes"] = list(self.kv_shapes)
        fields["extra"] = [list(pair) for pair in sorted(self.extra)]
        document = {"encoding": FINGERPRINT_ENCODING_VERSION, "layout": fields}
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_canonical(cls, raw: bytes) -> LayoutFingerprint:
        """The fingerprint whose `canonical` encoding is ``raw``; raises ValueError for
        bytes that are not exactly such an encoding (another encoding version, a field this
        release does not know, a non-canonical spelling): what a client registers must
        hash to the digest its objects carry."""
        try:
            document = json.loads(raw)
            if document.get("encoding") != FINGERPRINT_ENCODING_VERSION:
                raise ValueError(
                    f"encoding {document.get('encoding')!r}, this release reads {FINGERPRINT_ENCODING_VERSION}"
                )
            layout = dict(document["layout"])
            layout["kv_shapes"] = tuple(layout["kv_shapes"])
            layout["extra"] = tuple((str(name), str(value)) for name, value in layout["extra"])
            fingerprint = cls(**layout)
        except KeyError as err:
            raise ValueError(f"not a canonical layout fingerprint: it has no field {err}") from None
        except (ValueError, TypeError, AttributeError, RecursionError) as err:
            raise ValueError(f"not a canonical layout fingerprint: {err}") from None
        if fingerprint.canonical() != bytes(raw):
            raise ValueError("not a canonical layout fingerprint: its fields encode to other bytes")
        return fingerprint

    def differing_fields(self, other: LayoutFingerprint) -> list[str]:
        """The names of the fields in which ``other`` differs (``extra`` by its names:
        ``extra.block_size``), in field order."""
        names = []
        for name in (f.name for f in fields(self)):
            if name == "extra":
                mine, theirs = dict(self.extra), dict(other.extra)
                names += [f"extra.{n}" for n in sorted(mine.keys() | theirs.keys()) if mine.get(n) != theirs.get(n)]
            elif getattr(self, name) != getattr(other, name):
                names.append(name)
        return names

    def digest(self) -> bytes:
        """16 bytes that stand for the whole layout inside every key."""
        return blake2b(self.canonical(), digest_size=KEY_BYTES, person=_PERSON_LAYOUT).digest()

    def short(self) -> str:
        """A one-line form for logs and status: readable parts plus the digest."""
        return (
            f"{self.model_id} dtype={self.kv_dtype} tp={self.tp_rank}/{self.tp_size} "
            f"pp={self.pp_rank} chunk={self.chunk_size} ns={self.key_namespace} "
            f"#{short_digest(self.digest())}"
        )


NAMESPACE_UNKNOWN = 0
"""The namespace tag of an object whose header does not record one (stored by a release
before tags, or by a writer that did not say)."""


def namespace_tag(namespace: str) -> int:
    """The 64-bit tag that stands for ``engine.key_namespace`` in every object header.

    A digest, not the name: headers are fixed-size, and the tag only has to tell
    namespaces apart for `kvharbor purge --namespace` (64 bits: no two namespaces of
    one cache collide in practice; a collision would purge too much, never read a
    wrong byte). Never `NAMESPACE_UNKNOWN`.
    """
    raw = blake2b(namespace.encode("utf-8"), digest_size=8, person=_PERSON_NAMESPACE).digest()
    return int.from_bytes(raw, "little") or 1


SHORT_DIGEST_HEX = 12
"""Hex digits of `short_digest`."""


def short_digest(fingerprint: bytes) -> str:
    """The short form of a fingerprint digest that logs, status and ``--layout`` use:
    its first `SHORT_DIGEST_HEX` hex digits (as in `LayoutFingerprint.short`)."""
    return fingerprint.hex()[:SHORT_DIGEST_HEX]


def _salt_bytes(salt: str | None) -> bytes:
    # Length-prefixed so that no salt, an empty salt and a salt that happens to
    # look like token bytes are all distinct inputs.
    if salt is None:
        return b"\x00"
    if not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(salt).__name__}")
    raw = salt.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def token_bytes(token_ids: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32 bytes, the form every key hashes.

    Raises ValueError (out of range) or TypeError (not an integer) naming the
    first bad token and its 0-based position.
    """
    try:
        # One C-level pass over the list; the fastest packing the standard
        # library offers, and it range-checks every id on the way.
        packed = array.array("I", token_ids)
    except (OverflowError, TypeError):
        _raise_bad_token(token_ids)
        raise  # No single token is to blame (e.g. not a sequence at all).
    assert packed.itemsize == 4, "array('I') is 4 bytes on every supported platform"
    if sys.byteorder == "big":
        packed.byteswap()  # Big-endian hosts hash the same bytes as little-endian ones.
    return memoryview(packed).cast("B")


def _raise_bad_token(token_ids: Sequence[int]) -> None:
    """Raise the error that names the first token `array` refused, if one is to blame."""
    for position, token in enumerate(token_ids):
        try:
            value = operator.index(token)
        except TypeError:
            raise TypeError(f"token id {token!r} at position {position} is not an integer") from None
        if not 0 <= value <= TOKEN_ID_MAX:
            raise ValueError(f"token id {value} at position {position} is outside 0..{TOKEN_ID_MAX}")


def chunk_keys(
    fingerprint_digest: bytes,
    chunk_size: int,
    token_ids: Sequence[int],
    salt: str | None = None,
    parent: bytes = _ROOT_PARENT,
) -> list[ChunkKey]:
    """Prefix-chained keys, one per *full* chunk of ``token_ids``.

    key_i = BLAKE2b-128(fingerprint digest || key_{i-1} || [salt, i = 0] || tokens_i)

    Chaining makes key i stand for the whole prefix up to chunk i, so a lookup
    can stop at the first miss. A trailing partial chunk gets no key: its KV
    would change once more tokens arrive. ``parent`` continues a chain from a
    known key (the salt then enters no more).

    Every token id is checked, those of the partial tail too: an id that
    cannot be a token is an error wherever it stands (and packing the whole
    list is cheaper than slicing it first).
    """
    check_key(fingerprint_digest)
    check_key(parent)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    salt_part = _salt_bytes(salt)  # Type-checked even when there is nothing to key.
    data = token_bytes(token_ids)
    stride = chunk_size * 4
    end = len(token_ids) // chunk_size * stride
    # The hasher state after the personalisation and fingerprint digest is the
    # same for every chunk: build it once and continue from a copy, which gives
    # bit-identical digests without re-initialising BLAKE2b per chunk.
    start = blake2b(fingerprint_digest, digest_size=KEY_BYTES, person=_PERSON_CHUNK)
    keys: list[ChunkKey] = []
    previous = parent
    for offset in range(0, end, stride):
        h = start.copy()
        h.update(previous)
        if offset == 0 and parent == _ROOT_PARENT:
            h.update(salt_part)
        h.update(data[offset : offset + stride])
        previous = h.digest()
        keys.append(ChunkKey(previous))
    return keys


def engine_page_key(fingerprint_digest: bytes, page_hash: bytes) -> ChunkKey:
    """The key of one page that an engine names by a prefix-chained hash of its own (SGLang's
    SHA-256 page hashes), inside the layout ``fingerprint_digest``.

    key = BLAKE2b-128(fingerprint digest || page hash), in a hash domain of its own: such a
    key never equals a `chunk_keys` key, a fingerprint or a fragment key. The engine's hash
    already stands for the whole prefix up to its page, so the keys chain as `chunk_keys`
    do; the fingerprint keeps pages of another layout, page size or rank apart.
    """
    check_key(fingerprint_digest)
    if not page_hash:
        raise ValueError("an engine page hash is empty")
    h = blake2b(fingerprint_digest, digest_size=KEY_BYTES, person=_PERSON_ENGINE_PAGE)
    h.update(page_hash)
    return ChunkKey(h.digest())


def max_hit_tokens(num_tokens: int, chunk_size: int) -> int:
    """The most tokens a prompt of ``num_tokens`` can hit: floor(n / c) * c."""
    assert chunk_size > 0
    return (max(num_tokens, 0) // chunk_size) * chunk_size


def card_layout(fragment_bytes: int) -> bytes:
    """What a card tier adds to the layout of what it stores: its fragment size (the
    largest object it stores, header included). Canonical, like `LayoutFingerprint.canonical`."""
    if fragment_bytes <= 0:
        raise ValueError(f"fragment_bytes must be > 0, got {fragment_bytes}")
    return json.dumps({"card": {"fragment_bytes": fragment_bytes}}, sort_keys=True, separators=(",", ":")).encode()


def tier_fingerprint(fingerprint: bytes, tier_layout: bytes) -> bytes:
    """The fingerprint a tier whose own settings change stored bytes stores objects under:
    a digest of the engine's ``fingerprint`` and the tier's canonical ``tier_layout``."""
    check_key(fingerprint)
    return blake2b(bytes(fingerprint) + tier_layout, digest_size=KEY_BYTES, person=_PERSON_TIER_LAYOUT).digest()
