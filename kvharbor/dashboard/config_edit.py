"""Editing the config from the page: validated as a whole, written back, applied where it can be.

``POST /api/config`` sends a patch: a mapping laid over the config file's own document
(mappings merged key by key, a list such as ``storage.tiers`` replaced whole). The result,
with the environment's ``KVHARBOR__...`` overrides over it as at a start, is validated
by the config model itself (`kvharbor.config.validate_config`); refused, nothing changes.
Accepted, the file is rewritten (atomically, keeping its mode; its comments are lost)
and the changed keys are sorted:

- **at once** (`LIVE_KEYS`): settings the running gateway reads at each use; the
  gateway's config in force is replaced by one that differs from the old one in these
  keys only;
- **at the next start**: all others. Most are captured when the gateway starts (the
  socket, the ring and shared memory, the tiers, ``engine.chunk_size`` which engines
  read, the dashboard's bind and buffers); the gateway serves on as it started until then.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvharbor.config import Config, ConfigError, env_overrides, merge_documents, read_yaml, validate_config
from kvharbor.dashboard.guard import exposure_problem

EDIT_SETTING = "dashboard.allow_config_edit"

LIVE_KEYS = frozenset({
    "dashboard.auth_token",  # `guard.Guard` reads the dashboard section on every request.
    "dashboard.allowed_hosts",
    "dashboard.allow_config_edit",  # Read by the next POST.
    "gateway.clients_max",  # `Gateway._admit` reads it for every new connection.
})  # fmt: skip
"""Dotted keys a running gateway applies as soon as an edit is accepted; each is read
from the config in force at its every use (tests prove each one takes effect)."""


class ConfigEditRefused(Exception):
    """An edit that changed nothing; ``status`` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class EditOutcome:
    changed: list[str]
    applied_now: list[str]
    at_next_start: list[str]
    written: str
    """The file the new config was written to."""


def dump(config: Config) -> dict[str, Any]:
    """The config as a JSON document, every tier with its own type's fields."""
    return config.model_dump(mode="json", serialize_as_any=True)


def leaves(document: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf (a list is one leaf: tiers change as a whole)."""
    flat: dict[str, Any] = {}
    for key, value in document.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(leaves(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def write_document(path: Path, document: Mapping[str, Any]) -> None:
    """Replace ``path`` by ``document`` at once (JSON for a ``.json`` file, else YAML), keeping its mode."""
    text = json.dumps(document, indent=2) if path.suffix == ".json" else yaml.safe_dump(dict(document), sort_keys=False)
    mode = path.stat().st_mode & 0o7777
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), mode)
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


class ConfigEditor:
    """Applies patches to the config file at ``path`` and to the gateway's config in force.

    ``current`` gives the config in force; ``apply`` makes a config the one in force
    (called only with one that differs from ``current()`` in `LIVE_KEYS`). One edit at a time.
    """

    def __init__(
        self,
        path: Path | None,
        current: Callable[[], Config],
        apply: Callable[[Config], None],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self._current = current
        self._apply = apply
        self._environ = os.environ if environ is None else environ
        self._lock = threading.Lock()

    def ensure_allowed(self) -> None:
        """Refuse (403) while ``dashboard.allow_config_edit`` is off: said before anything
        of a request is read, so a refused edit learns nothing about its body either."""
        if not self._current().dashboard.allow_config_edit:
            raise ConfigEditRefused(403, f"config editing is disabled ({EDIT_SETTING}: false)")

    def edit(self, patch: Any) -> EditOutcome:
        """Validate, write and apply ``patch``; raises `ConfigEditRefused` with nothing changed."""
        with self._lock:
            self.ensure_allowed()
            running = self._current()
            if not isinstance(patch, Mapping):
                raise ConfigEditRefused(400, "the body must be a JSON object: the config keys to change")
            if self.path is None:
                raise ConfigEditRefused(
                    409, "the gateway was started without a config file (--config or KVHARBOR_CONFIG): nowhere to write"
                )
            try:
                document = merge_documents(read_yaml(self.path), patch)
                edited = validate_config(merge_documents(document, env_overrides(self._environ)), "posted config")
            except ConfigError as err:
                raise ConfigEditRefused(400, str(err)) from None
            problem = exposure_problem(edited.dashboard)
            if problem is not None:
                raise ConfigEditRefused(400, f"invalid kvharbor config (posted config): {problem}")
            before, after = leaves(dump(running)), leaves(dump(edited))
            changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
            live = [key for key in changed if key in LIVE_KEYS]
            try:
                write_document(self.path, document)
            except OSError as err:
                why = err.strerror or str(err)
                raise ConfigEditRefused(500, f"cannot write the config file {self.path}: {why}") from None
            if live:
                self._apply(self._with_live(running, {key: after[key] for key in live}))
            return EditOutcome(changed, live, [key for key in changed if key not in LIVE_KEYS], str(self.path))

    @staticmethod
    def _with_live(running: Config, values: Mapping[str, Any]) -> Config:
        """``running`` with the live keys' new values, validated anew (the same gateway
        names and digest: no storage or card key is among them)."""
        document = dump(running)
        for dotted, value in values.items():
            *path, last = dotted.split(".")
            node = document
            for part in path:
                node = node[part]
            node[last] = value
        return validate_config(document, "posted config")
