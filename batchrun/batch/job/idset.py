"""A set of custom_ids at about 16 bytes each, for duplicate detection over millions of lines."""

from __future__ import annotations

import hashlib

import numpy as np

_MIN_BUFFER = 1 << 14
_BUCKETS = 256


class IdSet:
    """Keeps 128-bit BLAKE2b digests of the ids (a collision needs ~10^19 ids) in 256 sorted
    numpy arrays, one per first digest byte, and the newest in a small Python set that is merged
    into them now and then. Merging one bucket at a time keeps the peak near 16 bytes an id (a
    single sorted array would briefly need twice that while it is copied).

    numpy's fixed-width bytes type drops trailing NUL bytes, so digests are stored without them
    (still one-to-one for fixed-length digests) and compared the same way everywhere.
    """

    def __init__(self) -> None:
        empty = np.empty(0, dtype="S16")
        self._buckets = [empty] * _BUCKETS
        self._stored = 0
        self._recent: set[bytes] = set()

    def __len__(self) -> int:
        return self._stored + len(self._recent)

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest() \
            .rstrip(b"\0")

    def __contains__(self, key: str) -> bool:
        return self._has(self._digest(key))

    def _has(self, d: bytes) -> bool:
        if d in self._recent:
            return True
        s = self._buckets[d[0] if d else 0]
        if s.size:
            i = int(s.searchsorted(d))
            return i < s.size and s[i] == d
        return False

    def add(self, key: str) -> bool:
        """Add `key`; True when it was not there yet."""
        d = self._digest(key)
        if self._has(d):
            return False
        self._recent.add(d)
        if len(self._recent) >= max(_MIN_BUFFER, self._stored >> 6):
            self._merge()
        return True

    def _merge(self) -> None:
        groups: dict[int, list[bytes]] = {}
        for d in self._recent:
            groups.setdefault(d[0] if d else 0, []).append(d)
        self._recent = set()
        for b, digests in groups.items():
            merged = np.concatenate([self._buckets[b], np.array(digests, dtype="S16")])
            merged.sort()
            self._buckets[b] = merged
            self._stored += len(digests)
