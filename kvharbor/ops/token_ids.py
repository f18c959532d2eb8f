"""Token ids as a user types them: ``kvharbor keys`` reads them from stdin, ``kvharbor doctor
--prompt-file`` from a file."""

from __future__ import annotations

import re

_DECIMAL = re.compile(r"[+-]?[0-9]+")


def parse_token_ids(text: str) -> list[int]:
    """Whitespace-separated decimal token ids; ValueError names the bad token and position.

    The range (0..2**32-1) is checked by `chunk_keys`, whose error also names
    the token and its position.
    """
    words = text.split()
    try:
        return [int(word) for word in words]
    except ValueError:
        pass
    for position, word in enumerate(words):
        if not _DECIMAL.fullmatch(word):
            raise ValueError(f"token {word!r} at position {position} is not an integer")
    raise AssertionError("int() refused a decimal word")  # pragma: no cover
