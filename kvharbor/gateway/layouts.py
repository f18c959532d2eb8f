"""The layout registry: which full layouts stand behind the fingerprint digests in the cache.

A stored object carries only its layout's 16-byte digest, which names no model, dtype
or shape. So every client registers the canonical fingerprints of its layouts at the
handshake (HELLO), and the gateway keeps them: in memory for `status`, and in a small
file (`REGISTRY_FILE`) beside the data of each persistent tier, so that ``kvharbor
status`` and ``kvharbor doctor`` can still name the layouts of what a tier holds after
a restart, or with no gateway running at all (`read_registry_file`).

Contracts:

- A file is written whole to a temporary name and renamed over the old one: a reader
  sees the old registry or the new one, never half of one. It is written only when a
  layout appears or another client registers it, so a handshake costs no write as a rule.
- A file that cannot be read or parsed is ignored with one log line (it only names
  layouts: nothing is read from the cache on its word); one that cannot be written is
  said once, and the gateway keeps serving.
- ``--start-clean=1`` empties the tiers and so the registry: the files are rewritten empty.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.gateway.status import RegisteredLayout
from kvharbor.hal.tempfiles import temp_name, this_machine
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.gateway.layouts")

REGISTRY_FILE = "layouts.json"
"""The registry's file in each persistent tier's state directory."""
REGISTRY_FORMAT = 1
STAGING_STEM = "layouts"
"""The stem of the file's temporary name (`kvharbor.hal.tempfiles`: a dead writer's is swept)."""
REGISTRY_FILE_BYTES_MAX = 4 << 20
"""A registry file larger than this is not read (a layout is under a kilobyte)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    fingerprint: LayoutFingerprint
    registered_by: str
    registered_at_s: float


def registry_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / REGISTRY_FILE


def read_registry_file(path: Path) -> list[RegisteredLayout]:
    """The layouts a registry file names (not registered in this run); raises ValueError
    naming the file for one that is not a registry, OSError for one that cannot be read."""
    with path.open("rb") as file:
        raw = file.read(REGISTRY_FILE_BYTES_MAX + 1)
    if len(raw) > REGISTRY_FILE_BYTES_MAX:
        raise ValueError(f"{path} exceeds {REGISTRY_FILE_BYTES_MAX} bytes: not a layout registry")
    try:
        document = json.loads(raw)
        if document["format"] != REGISTRY_FORMAT:
            raise ValueError(f"format {document['format']!r}, this release reads {REGISTRY_FORMAT}")
        layouts = []
        for item in document["layouts"]:
            fingerprint = LayoutFingerprint.from_canonical(item["canonical"].encode())
            layouts.append(
                RegisteredLayout(
                    digest=fingerprint.digest().hex(),
                    fingerprint=fingerprint,
                    registered_by=str(item["registered_by"]),
                    registered_at_s=float(item["registered_at_s"]),
                    this_run=False,
                )
            )
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as err:
        raise ValueError(f"{path} is not a layout registry: {err}") from None
    return layouts


def merge(layouts: Iterable[RegisteredLayout]) -> list[RegisteredLayout]:
    """One entry per digest, the latest registration of each; oldest first."""
    latest: dict[str, RegisteredLayout] = {}
    for layout in layouts:
        known = latest.get(layout.digest)
        if known is None or layout.registered_at_s > known.registered_at_s:
            latest[layout.digest] = layout
    return sorted(latest.values(), key=lambda layout: layout.registered_at_s)


class LayoutRegistry:
    """The gateway's registry, kept in ``state_dirs`` (one per persistent tier)."""

    def __init__(self, state_dirs: Sequence[str], start_clean: bool) -> None:
        self._paths = [registry_path(d) for d in state_dirs]
        self._lock = threading.Lock()
        self._once = OnceLog(_log)
        self._entries: dict[bytes, _Entry] = {}
        self._this_run: set[bytes] = set()
        self._machine = this_machine()
        if start_clean:
            self._write(keep_on_disk=False)  # The tiers were emptied: no layout is present any more.
            return
        for known in merge(self._read_files()):
            self._entries[known.fingerprint.digest()] = _Entry(
                known.fingerprint, known.registered_by, known.registered_at_s
            )

    def register(self, fingerprints: Sequence[LayoutFingerprint], client: str) -> None:
        """``client`` runs these layouts; written to the tiers' files if that is news."""
        now = time.time()
        with self._lock:
            changed = False
            for fingerprint in fingerprints:
                digest = fingerprint.digest()
                known = self._entries.get(digest)
                changed |= known is None or known.registered_by != client
                self._entries[digest] = _Entry(fingerprint, client, now)
                self._this_run.add(digest)
            if changed:
                self._write()

    def layouts(self) -> list[RegisteredLayout]:
        with self._lock:
            return [
                RegisteredLayout(
                    digest=digest.hex(),
                    fingerprint=entry.fingerprint,
                    registered_by=entry.registered_by,
                    registered_at_s=entry.registered_at_s,
                    this_run=digest in self._this_run,
                )
                for digest, entry in sorted(self._entries.items(), key=lambda item: item[1].registered_at_s)
            ]

    def _read_files(self) -> list[RegisteredLayout]:
        found: list[RegisteredLayout] = []
        for path in self._paths:
            found += self._read_file(path)
        return found

    def _read_file(self, path: Path) -> list[RegisteredLayout]:
        try:
            return read_registry_file(path)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            self._once.say(
                f"read:{path}", f"layout registry {path} ignored ({err}); it is rewritten at the next registration"
            )
            return []

    def _write(self, keep_on_disk: bool = True) -> None:
        """Write the registry to every tier's file (under the lock). Another gateway may
        share a tier's directory: what its file names already is kept (``keep_on_disk``)."""
        mine = [
            RegisteredLayout(digest.hex(), entry.fingerprint, entry.registered_by, entry.registered_at_s, False)
            for digest, entry in self._entries.items()
        ]
        for path in self._paths:
            layouts = merge([*(self._read_file(path) if keep_on_disk else []), *mine])
            document = {
                "format": REGISTRY_FORMAT,
                "layouts": [
                    {
                        "canonical": layout.fingerprint.canonical().decode(),
                        "short": layout.short,
                        "registered_by": layout.registered_by,
                        "registered_at_s": layout.registered_at_s,
                    }
                    for layout in layouts
                ],
            }
            staging = path.with_name(temp_name(STAGING_STEM, self._machine))
            try:
                staging.write_bytes(json.dumps(document, indent=1).encode())
                staging.replace(path)
            except OSError as err:
                with contextlib.suppress(OSError):
                    staging.unlink()
                self._once.say(
                    f"write:{path}",
                    f"cannot write the layout registry {path} ({err.strerror or err}); after a restart, status "
                    "names the layouts registered since",
                )
            else:
                self._once.clear(f"write:{path}", f"layout registry {path} written again")
