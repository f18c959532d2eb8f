"""``KVHARBOR=1`` makes an SGLang launch use kvharbor as its HiCache storage backend.

SGLang runs the general plugins of the entry point group ``sglang.srt.plugins``
(`register`) in every process before it builds its arguments: in ``sglang serve``,
``python -m sglang.launch_server``, the Python API's ``Engine`` and the scheduler
processes. `register` hooks ``ServerArgs.resolve_once`` so that, with
``KVHARBOR=1``, the launch's arguments are filled in before SGLang resolves them
(`plan`):

- ``--enable-hierarchical-cache``, ``--hicache-storage-backend dynamic`` and the
  extra config naming `backend.KVHarborStorage` with ``interface_v1``, merged into
  any extra config the user gave; an explicit ``--hicache-storage-backend`` always
  wins, and a line says so;
- the radix (prefix) cache is re-enabled when the launch disabled it (HiCache needs
  it), unless ``KVHARBOR_FORCE_RADIX=0``: then kvharbor stays off and says why;
- ``KVHARBOR_SGLANG_HOST_GB`` sets the host tier's size (``--hicache-size``);
- ``prefetch_threshold``: SGLang never reads a prefix shorter than it back from
  storage (default 256 tokens); kvharbor sets it to one page unless the user set
  it, and the line says which value is in force.

An unexpected error while filling the arguments leaves them as they were: SGLang
starts without the cache, and the traceback is logged once. Where SGLang has no
plugin hooks, `explicit_flags` are the flags to pass.

The same hook point flushes at shutdown (`shutdown.flush_backups`): SGLang stops
its storage threads without writing the pages still queued for storage.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvharbor.connector.env import enabled, env_flag
from kvharbor.telemetry.log import PREFIX, OnceLog, attach_to_engine_log, get_logger

_log = get_logger("kvharbor.connector.sglang")
_once = OnceLog(_log)

ENV_FORCE_RADIX = "KVHARBOR_FORCE_RADIX"
ENV_HOST_GB = "KVHARBOR_SGLANG_HOST_GB"
BACKEND_NAME = "kvharbor"
BACKEND_MODULE = "kvharbor.connector.sglang.backend"
BACKEND_CLASS = "KVHarborStorage"
PREFETCH_THRESHOLD_KEY = "prefetch_threshold"
ONE_PAGE_TOKENS = 1
"""SGLang raises the threshold to at least one page (``max(threshold, page_size)``), so 1 is one page."""

RESOLVE_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
STOP_TARGET = "sglang.srt.managers.cache_controller.HiCacheController._stop_storage_threads"

ARG_FIELDS = (
    "enable_hierarchical_cache",
    "hicache_storage_backend",
    "hicache_storage_backend_extra_config",
    "disable_radix_cache",
    "hicache_size",
)
"""The ServerArgs fields `plan` reads and may set."""


def backend_extra_config() -> dict[str, Any]:
    """The extra config that names kvharbor's backend to SGLang's dynamic factory."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": BACKEND_MODULE,
        "class_name": BACKEND_CLASS,
        "interface_v1": 1,
        PREFETCH_THRESHOLD_KEY: ONE_PAGE_TOKENS,
    }


def explicit_flags() -> str:
    """The SGLang flags that ``KVHARBOR=1`` stands for, to pass where it has no hook."""
    return (
        "--enable-hierarchical-cache --hicache-storage-backend dynamic "
        f"--hicache-storage-backend-extra-config '{json.dumps(backend_extra_config())}'"
    )


@dataclass(frozen=True, slots=True)
class Activation:
    """What `plan` decided: the ServerArgs fields to set, and the lines that say so."""

    fields: dict[str, Any] = field(default_factory=dict)
    lines: tuple[tuple[int, str], ...] = ()
    """(log level, line without the prefix)."""


def read_extra_config(value: Any) -> dict[str, Any]:
    """The user's ``--hicache-storage-backend-extra-config``: JSON text, or ``@file``
    (JSON or YAML); raises ValueError naming the flag."""
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    text = str(value)
    try:
        # SGLang's own reader also takes TOML; JSON and YAML cover what kvharbor merges into.
        document = yaml.safe_load(Path(text[1:]).read_text()) if text.startswith("@") else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise ValueError(f"--hicache-storage-backend-extra-config cannot be read: {err}") from None
    if not isinstance(document, dict):
        raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
    return document


def is_kvharbor(extra: Mapping[str, Any]) -> bool:
    return extra.get("module_path") == BACKEND_MODULE and extra.get("class_name") == BACKEND_CLASS


def plan(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Activation:
    """What ``KVHARBOR=1`` changes in a launch whose `ARG_FIELDS` are ``args``; raises
    ValueError (naming the flag) for a user's extra config that cannot be read."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return Activation()
    backend = args.get("hicache_storage_backend")
    extra = read_extra_config(args.get("hicache_storage_backend_extra_config"))
    if backend is not None:
        if backend == "dynamic" and is_kvharbor(extra):
            return Activation()  # Already kvharbor's (the flags, or this hook in another process).
        return Activation(
            lines=(
                (
                    logging.WARNING,
                    f"KVHARBOR=1 but an explicit --hicache-storage-backend ({backend}) was given; it wins "
                    "and kvharbor stays off. Remove it so that kvharbor becomes the storage backend",
                ),
            )
        )
    fields: dict[str, Any] = {}
    lines: list[tuple[int, str]] = []
    if args.get("disable_radix_cache"):
        if not env_flag(ENV_FORCE_RADIX, environ, default=True):
            return Activation(
                lines=(
                    (
                        logging.WARNING,
                        "KVHARBOR=1 but the radix cache is disabled and KVHARBOR_FORCE_RADIX=0; HiCache "
                        "can't run without it, so the kvharbor backend stays off for this launch",
                    ),
                )
            )
        fields["disable_radix_cache"] = False
        lines.append(
            (
                logging.WARNING,
                "KVHARBOR=1 re-enabled SGLang's radix (prefix) cache, which the launch disabled: HiCache "
                "needs it (KVHARBOR_FORCE_RADIX=0 keeps it disabled, and kvharbor off)",
            )
        )
    merged = {**backend_extra_config(), **extra}
    if PREFETCH_THRESHOLD_KEY in extra:
        lines.append(
            (
                logging.INFO,
                f"prefetch_threshold {extra[PREFETCH_THRESHOLD_KEY]} tokens (the launch's) is in force: "
                "shorter prefixes are never read back from storage",
            )
        )
    else:
        lines.append(
            (
                logging.INFO,
                f"prefetch_threshold set to {ONE_PAGE_TOKENS} (one page, SGLang's minimum): every "
                "prefix of a page or more is read back from storage",
            )
        )
    host_gb = environ.get(ENV_HOST_GB, "").strip()
    if host_gb:
        if host_gb.isdigit() and int(host_gb) > 0:
            fields["hicache_size"] = int(host_gb)
            lines.append((logging.INFO, f"{ENV_HOST_GB}={host_gb}: SGLang's host tier holds {host_gb} GB"))
        else:
            lines.append(
                (
                    logging.WARNING,
                    f"{ENV_HOST_GB}={host_gb!r} is not a whole number of GB above 0; ignored: SGLang "
                    "sizes its host tier itself (--hicache-ratio)",
                )
            )
    fields["enable_hierarchical_cache"] = True
    fields["hicache_storage_backend"] = "dynamic"
    fields["hicache_storage_backend_extra_config"] = json.dumps(merged)
    lines.append((logging.INFO, "KVHARBOR=1: kvharbor is SGLang's HiCache storage backend"))
    return Activation(fields, tuple(lines))


def fill_server_args(server_args: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Apply `plan` to ``server_args`` (SGLang's ServerArgs, before resolution); True if
    kvharbor became its backend. Never raises: a failure leaves the arguments as they were."""
    before = {name: getattr(server_args, name) for name in ARG_FIELDS}
    try:
        activation = plan(before, environ)
        for name, value in activation.fields.items():
            setattr(server_args, name, value)
    except ValueError as err:
        _once.say("bad-extra", f"{err}; kvharbor stays off for this launch", level=logging.ERROR)
        return False
    except Exception:
        for name, value in before.items():
            setattr(server_args, name, value)
        if _once.say("fill", "could not enable the kvharbor HiCache backend; SGLang starts without the cache; "
                     f"meanwhile pass the flags explicitly: {explicit_flags()}", level=logging.ERROR):  # fmt: skip
            _log.exception("%sthe error that stopped it", PREFIX)
        return False
    for level, line in activation.lines:  # Once per launch: its other processes find the backend set.
        _log.log(level, "%s%s", PREFIX, line)
    return bool(activation.fields)


def _before_resolve(server_args: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(server_args, "_resolution_finished", False):
        fill_server_args(server_args)


def _flush_then_stop(original: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    from kvharbor.connector.sglang.shutdown import flush_if_kvharbor

    flush_if_kvharbor(controller)
    return original(controller, *args, **kwargs)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point; SGLang runs it in each of its processes."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        if enabled():
            attach_to_engine_log()
            _once.say("no-hooks", f"SGLang plugin hooks unavailable; pass the --hicache-* flags explicitly: "
                      f"{explicit_flags()}")  # fmt: skip
        return
    # The flush serves explicit launches too: it acts only when kvharbor is the backend.
    HookRegistry.register(STOP_TARGET, _flush_then_stop, HookType.AROUND)
    if enabled():
        attach_to_engine_log()
        HookRegistry.register(RESOLVE_TARGET, _before_resolve, HookType.BEFORE)
