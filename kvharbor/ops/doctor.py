"""``kvharbor doctor``: the "no hits after a restart" checklist, automated for one prompt.

Given a prompt's token ids and the config, it computes the prompt's chunk keys for a
layout the gateway's registry names (`kvharbor.gateway.layouts`) with the same
function the connector uses (`kvharbor.cache.keys.chunk_keys`, as
`kvharbor.connector.vllm.layout.VllmLayout.keys` calls it: no second implementation
of hashing), asks the gateway where each chunk is (LOCATE, read-only: it counts no
lookup and moves nothing, `kvharbor.gateway.query`), and checks every other cause of
a miss it can see:

- the prompt is shorter than a chunk (a partial chunk is never stored);
- ``engine.require_cache_salt`` is on and the prompt has no salt (the connector skips it);
- the gateway was started with ``--start-clean=1`` (every tier emptied at its start);
- a tier does not accept writes (breaker open, health failed, did not open);
- the chunks are stored under another registered layout (and which fields differ), or
  without the salt given;
- no engine registered a layout with the gateway, or its log lacks the registration line.

With no gateway answering, the file tiers' manifests and registries are read instead
(read-only, `kvharbor.ops.disk`). Every check gives a `Finding`; a `PROBLEM` is a reason
the prompt misses (or would).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter

from kvharbor.cache.keys import chunk_keys, key_hex, token_bytes
from kvharbor.config import Config
from kvharbor.gateway.layouts import merge
from kvharbor.gateway.query import GatewayQuery, NoGateway
from kvharbor.gateway.status import GatewayStatus, RegisteredLayout
from kvharbor.hal.base import CapacityUsage
from kvharbor.ops.disk import locate_on_disk, read_disk
from kvharbor.ops.token_ids import parse_token_ids

REGISTRATION_LINE = re.compile(r"kvharbor: (\d+) (?:GPU )?cache tensors registered \(rank (\d+)")
"""The worker's line once its KV caches are registered (`kvharbor.connector.vllm.worker`)."""
OFF_LINE = re.compile(r"kvharbor: external KV cache turned off on this rank: (.*?)\. The engine keeps serving")
"""The restart rule's line (`kvharbor.connector.link.say_off`). A vLLM worker registers its
tensors before it reaches the gateway: a registration followed by this line is a connector
that started and then turned the cache off (no gateway answered, or it went away)."""
ENGINE_LOG_BYTES_MAX = 256 * 2**20
"""The most of an engine log read (its end: the latest start is what counts)."""
RANK_FIELDS = frozenset({"tp_rank", "pp_rank"})
"""Fields in which the layouts of one engine's ranks differ."""


class Verdict(enum.Enum):
    OK = "ok"
    INFO = "info"
    PROBLEM = "problem"
    """A reason this prompt misses, or would."""


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    """Which check: ``gateway``, ``prompt``, ``salt``, ``start_clean``, ``tiers``, ``card_layout``,
    ``engine``, ``engine_log``, ``layout``, ``chunks``, ``other_layouts``."""
    verdict: Verdict
    text: str


@dataclass(frozen=True, slots=True)
class ChunkPlace:
    index: int
    first_token: int
    key: str
    """The chunk's key, hex."""
    tiers: list[str]
    """The tiers that hold it; empty: none does."""


@dataclass(frozen=True, slots=True)
class DoctorReport:
    tokens: int
    chunk_size: int
    salt: str | None
    layout: RegisteredLayout | None
    """The layout the keys were computed for; None when no registered layout fits."""
    chunks: list[ChunkPlace]
    findings: list[Finding]
    gateway_answered: bool

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict is Verdict.PROBLEM]

    def to_json(self) -> str:
        return _REPORT.dump_json(self, indent=2).decode()


_REPORT = TypeAdapter(DoctorReport)


@dataclass(slots=True)
class _Where:
    """Where to look for keys: the gateway, or the file tiers on disk."""

    config: Config
    query: GatewayQuery | None
    tier_names: list[str] = field(default_factory=list)

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        if self.query is not None:
            holders = self.query.locate(keys)
            names = self.tier_names
        else:
            names, holders, _ = locate_on_disk(self.config, keys)
        return [[name for bit, name in enumerate(names) if mask >> bit & 1] for mask in holders]


def read_token_ids(path: Path) -> list[int]:
    """The token ids in ``path``: a JSON list of integers, or whitespace-separated integers;
    raises ValueError naming the file and what is wrong (the range is checked with the keys)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--prompt-file {path} does not exist") from None
    except UnicodeDecodeError:
        raise ValueError(f"--prompt-file {path} is not text: give token ids (or text with --model DIR)") from None
    except OSError as err:
        raise ValueError(f"--prompt-file {path} cannot be read ({err.strerror or err})") from None
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"--prompt-file {path} is empty: give token ids")
    if stripped.startswith(("[", "{")):
        try:
            ids = json.loads(stripped)
        except (ValueError, RecursionError):
            raise ValueError(f"--prompt-file {path} starts like JSON but is not a JSON list") from None
        if not isinstance(ids, list):
            raise ValueError(f"--prompt-file {path} is a JSON {type(ids).__name__}, not a list of token ids")
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(
                f"--prompt-file {path}: element {bad} ({ids[bad]!r}) is not a token id (an integer); give a JSON "
                "list of integers or whitespace-separated integers"
            )
        return ids
    try:
        return parse_token_ids(stripped)
    except ValueError as err:
        raise ValueError(
            f"--prompt-file {path}: {err}; give token ids (a JSON list or whitespace-separated integers), "
            "or text with --model DIR"
        ) from None


def tokenize(text: str, model_dir: Path) -> list[int]:
    """``text`` as the model's tokenizer encodes a completion prompt (special tokens added,
    as vLLM does for one; a chat request's template adds its own tokens)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {model_dir}: no tokenizer can be loaded from it ({err})") from None
    return list(tokenizer.encode(text))


def pick_layout(
    layouts: Sequence[RegisteredLayout], config: Config, layout_id: str | None
) -> tuple[RegisteredLayout | None, Finding]:
    """The layout to compute keys for: ``layout_id`` (a digest or its first characters), or
    the latest registered rank-0 layout with the config's chunk size and namespace. Raises
    ValueError for a ``layout_id`` that names no layout or more than one."""
    listing = "; ".join(f"{layout.digest[:12]} {layout.short}" for layout in layouts) or "none"
    if layout_id is not None:
        wanted = layout_id.lower().lstrip("#")
        matches = [layout for layout in layouts if layout.digest.startswith(wanted)]
        if len(matches) != 1:
            many = "names no registered layout" if not matches else f"names {len(matches)} layouts"
            raise ValueError(f"--layout {layout_id} {many}; registered: {listing}")
        return matches[0], Finding("layout", Verdict.INFO, f"keys for layout {matches[0].short} (--layout)")
    engine = config.engine
    # Left unset, the chunk size is the engine's to choose (whole blocks, an SGLang page).
    fits = [
        layout
        for layout in layouts
        if (layout.fingerprint.chunk_size == engine.chunk_size or not engine.chunk_size_set)
        and layout.fingerprint.key_namespace == engine.key_namespace
        and layout.fingerprint.tp_rank == 0
        and layout.fingerprint.pp_rank == 0
    ]
    if not fits:
        wanted = f"engine.chunk_size {engine.chunk_size} and " if engine.chunk_size_set else ""
        return None, Finding(
            "layout",
            Verdict.PROBLEM,
            f"no registered layout has {wanted}engine.key_namespace {engine.key_namespace!r} (registered: "
            f"{listing}): no engine of this config stored anything here; give --layout ID to check one of the "
            "registered layouts",
        )
    chosen = max(fits, key=lambda layout: layout.registered_at_s)
    return chosen, Finding(
        "layout", Verdict.INFO, f"keys for layout {chosen.short}, registered by {chosen.registered_by!r}"
    )


def _differences(mine: RegisteredLayout, theirs: RegisteredLayout) -> list[str]:
    a, b = mine.fingerprint, theirs.fingerprint
    out = []
    for name in a.differing_fields(b):
        if name.startswith("extra."):
            key = name.removeprefix("extra.")
            here, there = dict(a.extra).get(key), dict(b.extra).get(key)
        else:
            here, there = getattr(a, name), getattr(b, name)
        out.append(f"{name} ({here!r} here, {there!r} there)")
    return out


def _found(places: Sequence[Sequence[str]]) -> int:
    return sum(1 for tiers in places if tiers)


def _check_tiers(status: GatewayStatus) -> Finding:
    refusing = {
        name: condition
        for name, condition in status.tier_conditions().items()
        if condition.startswith(("breaker open", "failed")) or name in status.store.skipped
    }
    # A full card with key eviction off refuses every new write while its tier stays
    # "degraded", not failed: the seed guide's "the card accepts writes" check.
    for name, card in status.cards.items():
        if card.capacity_usage is CapacityUsage.CRITICAL and not card.key_eviction:
            refusing.setdefault(
                name, "the card is full (CapacityUsage CRITICAL) and key eviction is off: new chunks are not stored"
            )
    if refusing:
        text = "; ".join(f"{name}: {why}" for name, why in refusing.items())
        return Finding("tiers", Verdict.PROBLEM, f"tiers that take no writes now: {text}")
    return Finding("tiers", Verdict.OK, "every tier accepts writes: " + ", ".join(status.tier_conditions()))


def _check_engine(status: GatewayStatus) -> Finding:
    now = [layout for layout in status.layouts if layout.this_run]
    if now:
        by = sorted({layout.registered_by for layout in now})
        return Finding(
            "engine", Verdict.OK, f"{len(now)} layout(s) registered with this gateway since it started, by {by}"
        )
    return Finding(
        "engine",
        Verdict.PROBLEM,
        f"no engine registered a layout with this gateway (pid {status.pid}) since it started: no engine of "
        "this release attached (is the connector on: KVHARBOR=1 or --kv-transfer-config? the same gateway.socket?)",
    )


def check_engine_log(path: Path) -> Finding:
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - ENGINE_LOG_BYTES_MAX))
            text = file.read().decode("utf-8", "replace")
    except OSError as err:
        raise ValueError(f"--engine-log {path} cannot be read ({err.strerror or err})") from None
    lines = [m for m in REGISTRATION_LINE.finditer(text)]
    if not lines:
        return Finding(
            "engine_log",
            Verdict.PROBLEM,
            f"{path} has no 'kvharbor: N cache tensors registered' line: the connector did not start in that "
            "engine (is KVHARBOR=1 set, or --kv-transfer-config given?), or its log level hides INFO",
        )
    ranks = sorted({int(m.group(2)) for m in lines})
    # Only after the last registration: an engine restarted after an off line is on again.
    off = OFF_LINE.search(text, lines[-1].end())
    if off is not None:
        return Finding(
            "engine_log",
            Verdict.PROBLEM,
            f"{path}: the connector registered its cache tensors (ranks {ranks}), then turned the external cache "
            f"off: {off.group(1)}; restart the gateway, then the engine",
        )
    return Finding("engine_log", Verdict.OK, f"{path}: the connector registered its cache tensors (ranks {ranks})")


def diagnose(
    config: Config,
    token_ids: Sequence[int],
    salt: str | None = None,
    layout_id: str | None = None,
    engine_log: Path | None = None,
) -> DoctorReport:
    """Run every check for the prompt ``token_ids``; raises ValueError for bad input
    (a token id out of range, an unknown ``layout_id``, an unreadable ``engine_log``)."""
    token_bytes(token_ids)  # Bad input is refused before anything is asked: an id out of range names itself.
    findings: list[Finding] = []
    query, status, absent = _ask_gateway(config)
    if absent is not None:
        findings.append(absent)
    try:
        where = _Where(config, query, [t.name for t in status.store.tiers] if status else [])
        return _diagnose(config, token_ids, salt, layout_id, engine_log, status, where, findings)
    finally:
        if query is not None:
            query.close()


def _ask_gateway(config: Config) -> tuple[GatewayQuery | None, GatewayStatus | None, Finding | None]:
    """A query connection and the gateway's status, or the finding that none answers."""
    try:
        query = GatewayQuery.connect(config.gateway)
    except NoGateway as err:
        return None, None, _no_gateway(err)
    try:
        return query, query.status(), None
    except NoGateway as err:
        query.close()
        return None, None, _no_gateway(err)


def _no_gateway(err: NoGateway) -> Finding:
    return Finding("gateway", Verdict.PROBLEM, f"{err}; looking at the file tiers on disk instead")


def _diagnose(
    config: Config,
    token_ids: Sequence[int],
    salt: str | None,
    layout_id: str | None,
    engine_log: Path | None,
    status: GatewayStatus | None,
    where: _Where,
    findings: list[Finding],
) -> DoctorReport:
    if status is not None:
        findings.append(
            Finding("gateway", Verdict.OK, f"gateway pid {status.pid}, release {status.release}, at {status.socket}")
        )
        layouts = status.layouts
    else:
        on_disk = read_disk(config)
        layouts = merge(layout for tier in on_disk for layout in tier.layouts)
        findings += [
            Finding("tiers", Verdict.PROBLEM, f"tier {tier.name} at {tier.path}: {tier.problem}")
            for tier in on_disk
            if tier.problem
        ]
    layout, chosen = pick_layout(layouts, config, layout_id)
    findings.append(chosen)
    chunk_size = layout.fingerprint.chunk_size if layout is not None else config.engine.chunk_size
    findings.append(_check_prompt(len(token_ids), chunk_size))
    findings.append(_check_salt(config, salt))
    if status is not None:
        findings += [_check_start_clean(status), _check_tiers(status), *_check_card_layout(status)]
        findings.append(_check_engine(status))
    if engine_log is not None:
        findings.append(check_engine_log(engine_log))
    chunks: list[ChunkPlace] = []
    if layout is not None:
        keys = chunk_keys(bytes.fromhex(layout.digest), chunk_size, token_ids, salt)
        places = where.locate(keys) if keys else []
        chunks = [
            ChunkPlace(i, i * chunk_size, key_hex(key), tiers)
            for i, (key, tiers) in enumerate(zip(keys, places, strict=True))
        ]
        findings += _chunk_findings(chunks)
        if salt is not None and _found(places) < len(keys):
            findings += _stored_unsalted(layout, token_ids, salt, where)
    findings += _other_layouts(layout, layouts, token_ids, salt, where, missing=not chunks or _any_missing(chunks))
    return DoctorReport(len(token_ids), chunk_size, salt, layout, chunks, findings, gateway_answered=status is not None)


def _check_card_layout(status: GatewayStatus) -> list[Finding]:
    """Card tiers holding objects of the card's other settings (the seed's "fragment
    settings": ``card.fragment_bytes`` enters the layout of what a card tier stores).

    Such objects miss: found stale when read (counted, dropped), and before that held
    under a stored digest that no layout registered in this run maps to under the card's
    settings now. That second count can also be the objects of an engine that has not
    connected since the gateway started, so the text names both causes.
    """
    registered = {layout.digest for layout in status.layouts}
    connected = any(layout.this_run for layout in status.layouts)
    findings = []
    for tier in status.store.tiers:
        if tier.name not in status.cards:
            continue
        unknown = sum(n for digest, n in tier.layouts.items() if digest not in registered) if connected else 0
        if unknown:
            findings.append(
                Finding(
                    "card_layout",
                    Verdict.PROBLEM,
                    f"tier {tier.name} holds {unknown} object(s) under a layout that no engine of this gateway "
                    "has under the card's settings now: stored before card.fragment_bytes changed (misses, "
                    "dropped as they are read), or by an engine that has not connected since the gateway started",
                )
            )
        if tier.counters.stale:
            findings.append(
                Finding(
                    "card_layout",
                    Verdict.INFO,
                    f"tier {tier.name} dropped {tier.counters.stale} object(s) stored under other settings of the "
                    "card (card.fragment_bytes changed since): each was a miss, and its chunk is stored again "
                    "as it is recomputed",
                )
            )
    return findings


def _check_prompt(tokens: int, chunk_size: int) -> Finding:
    full, tail = divmod(tokens, chunk_size)
    if full == 0:
        return Finding(
            "prompt",
            Verdict.PROBLEM,
            f"the prompt has {tokens} tokens, shorter than a chunk ({chunk_size} tokens): a partial chunk is never "
            "stored, so this prompt never hits",
        )
    rest = f", and a partial tail of {tail} tokens that is never stored" if tail else ""
    return Finding("prompt", Verdict.OK, f"{tokens} tokens: {full} full chunk(s) of {chunk_size}{rest}")


def _check_salt(config: Config, salt: str | None) -> Finding:
    if salt is None and config.engine.require_cache_salt:
        return Finding(
            "salt",
            Verdict.PROBLEM,
            "engine.require_cache_salt is on and this prompt has no cache_salt (--salt): the connector neither "
            "looks it up nor stores it",
        )
    return Finding("salt", Verdict.OK, "no cache_salt" if salt is None else f"keys salted with cache_salt {salt!r}")


def _check_start_clean(status: GatewayStatus) -> Finding:
    if status.start_clean:
        return Finding(
            "start_clean",
            Verdict.PROBLEM,
            "the gateway was started with --start-clean=1: every tier was emptied at its start",
        )
    return Finding("start_clean", Verdict.OK, "the gateway was started without --start-clean")


def _stored_unsalted(layout: RegisteredLayout, token_ids: Sequence[int], salt: str, where: _Where) -> list[Finding]:
    """The prompt's chunks stored without a salt, when this request has one."""
    digest = bytes.fromhex(layout.digest)
    found = _found(where.locate(chunk_keys(digest, layout.fingerprint.chunk_size, token_ids, None)))
    if not found:
        return []
    full = len(token_ids) // layout.fingerprint.chunk_size
    return [
        Finding(
            "salt",
            Verdict.PROBLEM,
            f"{found} of {full} chunk(s) are stored without a cache_salt: the engine that stored them sent none, "
            f"this request sends {salt!r}",
        )
    ]


def _any_missing(chunks: Sequence[ChunkPlace]) -> bool:
    return not all(chunk.tiers for chunk in chunks)


def _chunk_findings(chunks: Sequence[ChunkPlace]) -> list[Finding]:
    if not chunks:
        return []
    found = sum(1 for c in chunks if c.tiers)
    if found == len(chunks):
        return [Finding("chunks", Verdict.OK, f"all {found} chunk(s) are stored")]
    first = next(c for c in chunks if not c.tiers)
    return [
        Finding(
            "chunks",
            Verdict.PROBLEM,
            f"{found} of {len(chunks)} chunk(s) are stored; chunk {first.index} (from token {first.first_token}) is "
            "the first missing, and keys are chained: a lookup hits at most the chunks before it",
        )
    ]


def _other_layouts(
    layout: RegisteredLayout | None,
    layouts: Sequence[RegisteredLayout],
    token_ids: Sequence[int],
    salt: str | None,
    where: _Where,
    missing: bool,
) -> list[Finding]:
    """Where this prompt's chunks are stored under the other registered layouts."""
    findings = []
    for other in layouts:
        if layout is not None and other.digest == layout.digest:
            continue
        keys = chunk_keys(bytes.fromhex(other.digest), other.fingerprint.chunk_size, token_ids, salt)
        found = _found(where.locate(keys)) if keys else 0
        if not found:
            continue
        stored = f"{found} of {len(keys)} chunk(s) of this prompt are stored under layout {other.short}"
        if layout is None:
            findings.append(Finding("other_layouts", Verdict.INFO, stored))
            continue
        differences = _differences(layout, other)
        if set(layout.fingerprint.differing_fields(other.fingerprint)) <= RANK_FIELDS:
            findings.append(Finding("other_layouts", Verdict.INFO, f"{stored}: another rank of the same engine"))
            continue
        findings.append(
            Finding(
                "other_layouts",
                Verdict.PROBLEM if missing else Verdict.INFO,
                f"{stored}, which differs from the layout checked in: {', '.join(differences)}",
            )
        )
    return findings
