"""Faults injected from another process: a control file the simulated card polls.

A gateway runs its card in its own process; a scenario or a test reaches it
through a small YAML file named by the card's ``control_path`` parameter. The
card checks the file's identity (time, inode, size) at most every ``control_poll_s`` of
wall time, before an operation, and applies each field whose value changed
since it last read the file. Writers replace the file atomically (write a
temporary file, rename it over), so a read never sees half a document.

Fields (all optional): ``target_up`` (bool), ``key_eviction`` (bool),
``supercap_ok`` (bool), ``temperature_c`` (number), ``power_cycles`` (int: the
card loses power each time it grows), ``fill_ratio`` (number in (0, 1]: fill
to it when it changes). An unreadable or invalid file is said once in the log
and ignored; the card keeps its state.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from typing import Any

import yaml

from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.hal.sim")


@dataclass(frozen=True, slots=True)
class ControlState:
    target_up: bool | None = None
    key_eviction: bool | None = None
    supercap_ok: bool | None = None
    temperature_c: float | None = None
    power_cycles: int | None = None
    fill_ratio: float | None = None


_TYPES: dict[str, tuple[type, ...]] = {
    "target_up": (bool,),
    "key_eviction": (bool,),
    "supercap_ok": (bool,),
    "temperature_c": (int, float),
    "power_cycles": (int,),
    "fill_ratio": (int, float),
}
if set(_TYPES) != {f.name for f in fields(ControlState)}:
    raise RuntimeError("sim control: every ControlState field needs its type in _TYPES")


def write_control(path: str, **state: Any) -> None:
    """Replace the control file atomically with ``state`` (for scenarios and tests)."""
    parse_control(state, path)  # Refuse what the card would refuse, here and now.
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        yaml.safe_dump(state, file)
    os.replace(temporary, path)


def parse_control(data: Any, path: str) -> ControlState:
    """A `ControlState` from a parsed document; raises ValueError naming the field."""
    if not isinstance(data, dict):
        raise ValueError(f"sim control file {path}: must hold a mapping")
    for name, value in data.items():
        kinds = _TYPES.get(name)
        if kinds is None:
            raise ValueError(f"sim control file {path}: unknown field {name!r}; known: {', '.join(sorted(_TYPES))}")
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ValueError(f"sim control file {path}: {name}: got {value!r}")
    return ControlState(**data)


class ControlFile:
    def __init__(self, path: str, poll_s: float) -> None:
        self.path = path
        self._poll_s = poll_s
        self._next_check = 0.0
        self._seen: tuple[int, int, int] | None = None
        """(mtime, inode, size) of the version read last: file times are coarse (a few ms),
        but each atomic replace is a new inode."""
        self._applied = ControlState()
        self._once = OnceLog(_log)

    def changes(self) -> tuple[ControlState, ControlState] | None:
        """(before, now) when the file changed since the last look, else None; cheap when not due."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self._poll_s
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as err:
            self._once.say("control", f"sim control file {self.path}: cannot be read ({err.strerror}); ignored")
            return None
        seen = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            with open(self.path) as file:
                state = parse_control(yaml.safe_load(file) or {}, self.path)
        except (OSError, yaml.YAMLError, ValueError) as err:
            self._once.say("control", f"{err}; ignored")
            return None
        self._once.clear("control")
        before, self._applied = self._applied, state
        return before, state
