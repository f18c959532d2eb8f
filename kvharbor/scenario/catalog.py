"""The shipped scenarios: ``kvharbor/scenarios/*.yaml``, installed with the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvharbor.scenario.schema import Scenario, ScenarioError, load_scenario


def shipped_dir() -> Path:
    return Path(str(resources.files("kvharbor.scenarios")))


def shipped() -> list[Path]:
    return sorted(shipped_dir().glob("*.yaml"))


def resolve(name_or_file: str) -> list[Scenario]:
    """``all``, a shipped scenario's name, or a file's path; raises `ScenarioError`."""
    if name_or_file == "all":
        return [load_scenario(path) for path in shipped()]
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return [load_scenario(path)]
    named = shipped_dir() / f"{name_or_file}.yaml"
    if named.exists():
        return [load_scenario(named)]
    names = ", ".join(p.stem for p in shipped())
    raise ScenarioError(f"no scenario named {name_or_file!r} (a file, 'all', or one of: {names})")
