"""What users see stays as recorded while the tree beneath it moves: every ``kvharbor``
command's ``--help``, every config key, and what the wheel ships besides its modules (its
pages, scenarios and entry points). A change to one of them is a change of contract:
record it on purpose (``KVHARBOR_RECORD_CONTRACTS=1 pytest tests/unit/test_contracts.py``)
and say so in the CHANGELOG."""

from __future__ import annotations

import argparse
import os
import typing
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest

from kvharbor.cli import build_parser
from kvharbor.config import Config

RECORDS = Path(__file__).parent / "fixtures" / "contracts"
RECORD_ENV = "KVHARBOR_RECORD_CONTRACTS"
HELP_COLUMNS = "100"
"""argparse wraps help to the terminal's width: the record is taken at this one."""


def check(name: str, text: str) -> None:
    """``text`` equals the record ``name``; with ``KVHARBOR_RECORD_CONTRACTS=1``, becomes it."""
    path = RECORDS / name
    if os.environ.get(RECORD_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no record {path}: take one with {RECORD_ENV}=1"
    assert text == path.read_text(), f"{name} changed: a user-visible contract (record it on purpose if meant)"


def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every command's words and its help, depth first in the order they are declared."""
    yield path, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def test_every_commands_help_is_as_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", HELP_COLUMNS)
    helps = [f"$ kvharbor {' '.join(words)} --help\n{text}" for words, text in parsers(build_parser())]
    assert len(helps) > 10  # Every command group, and the groups' own commands.
    check("cli_help.txt", "\n".join(helps))


def sections(annotation: object) -> Iterator[type[pydantic.BaseModel]]:
    """The config sections an annotation holds: itself, or those of a list or union of them."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from sections(arg)


def kinds(section: type[pydantic.BaseModel]) -> Iterator[type[pydantic.BaseModel]]:
    """A section and the kinds of it a list may hold (each tier type's), by their ``type``."""
    yield section
    for sub in sorted(section.__subclasses__(), key=lambda each: each.__name__):
        yield from kinds(sub)


def shown(annotation: object) -> str:
    """A key's type as a user reads it (``int``, not ``<class 'int'>``)."""
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def config_keys(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[str]:
    """Every config key as a dotted path (a list's sections under ``[type]``), with its type
    and its default (the home directory written ``~``: the record is any user's)."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if typing.get_origin(field.annotation) is list and (listed := list(sections(field.annotation))):
            yield f"{key}: list of sections"
            for section in (kind for each in listed for kind in kinds(each)):
                tag = section.model_fields.get("type")
                if tag is None or not tag.is_required():  # A kind a config names, not their base.
                    yield from config_keys(section, f"{key}[{tag.default if tag else section.__name__}].")
            continue
        if found := list(sections(field.annotation)):
            yield f"{key}: section"
            yield from config_keys(found[0], f"{key}.")
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        yield f"{key}: {shown(field.annotation)} = {default.replace(str(Path.home()), '~')}"


def test_every_config_key_is_as_recorded() -> None:
    check("config_keys.txt", "\n".join(config_keys(Config)) + "\n")


def test_what_the_wheel_ships_besides_modules_is_as_recorded(wheel: Path) -> None:
    """The non-module files and the entry points."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        data = sorted(n for n in names if not n.endswith(".py") and ".dist-info/" not in n)
        (entry_points,) = (archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    check("wheel_files.txt", "\n".join(data) + "\n")
    check("entry_points.txt", entry_points)
