"""Which namespace each layout's objects belong to, for the headers a store writes.

A put names its layout by fingerprint digest only; the namespace is inside the
fingerprint but cannot be read back out of a digest. So a writer says it once per
put (``PUT_PREPARE`` carries its `kvharbor.cache.keys.namespace_tag`), the store
remembers it per fingerprint here, and every tier writes it into the headers of
that fingerprint's objects, also the copies no client asked for (promotion,
demotion, the RAM refill: their source header says it, see `learn`).

A fingerprint digest determines its namespace (the namespace is one of its
fields), so one tag per fingerprint is all there is to know; a layout nobody
named yet is written as `NAMESPACE_UNKNOWN`.
"""

from __future__ import annotations

import threading

from kvharbor.cache.keys import NAMESPACE_UNKNOWN


class NamespaceTags:
    """Engine fingerprint digest -> namespace tag; thread-safe, a few entries per process."""

    def __init__(self) -> None:
        self._tags: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def learn(self, fingerprint: bytes, tag: int) -> None:
        """Remember ``fingerprint``'s namespace; an unknown tag teaches nothing."""
        if tag == NAMESPACE_UNKNOWN:
            return
        with self._lock:
            self._tags[bytes(fingerprint)] = tag

    def tag(self, fingerprint: bytes) -> int:
        """``fingerprint``'s namespace tag, or `NAMESPACE_UNKNOWN`."""
        return self._tags.get(bytes(fingerprint), NAMESPACE_UNKNOWN)
