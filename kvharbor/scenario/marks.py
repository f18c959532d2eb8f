"""YAML with line numbers: every mapping and list remembers where its items start.

A scenario error names the file, the line and the key (``card.yaml:14: steps[3].send.tokens:
...``). PyYAML's safe loader drops node marks when it builds Python objects; this
loader keeps them in `Marked` containers, which behave as plain dicts and lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml


class MarkedDict(dict[Any, Any]):
    """A mapping with the (1-based) line of itself and of each key."""

    line: int
    lines: dict[Any, int]


class MarkedList(list[Any]):
    """A list with the (1-based) line of itself and of each item."""

    line: int
    lines: list[int]


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> MarkedDict:
    result = MarkedDict()
    result.line = node.start_mark.line + 1
    result.lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        result[key] = loader.construct_object(value_node, deep=True)
        result.lines[key] = key_node.start_mark.line + 1
    return result


def _sequence(loader: _Loader, node: yaml.SequenceNode) -> MarkedList:
    result = MarkedList(loader.construct_object(child, deep=True) for child in node.value)
    result.line = node.start_mark.line + 1
    result.lines = [child.start_mark.line + 1 for child in node.value]
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _sequence)


def load_marked(text: str) -> Any:
    """Parse one YAML document keeping marks; raises `yaml.YAMLError` (its mark has the line)."""
    return yaml.load(text, Loader=_Loader)


def line_of(document: Any, path: Sequence[int | str]) -> int:
    """The line of the deepest node of ``document`` that ``path`` (keys and indexes) reaches."""
    line = getattr(document, "line", 1)
    node = document
    for part in path:
        if isinstance(node, MarkedDict) and part in node:
            line, node = node.lines[part], node[part]
        elif isinstance(node, MarkedList) and isinstance(part, int) and 0 <= part < len(node):
            index: int = part
            line, node = node.lines[index], node[index]
        else:
            break
    return line
