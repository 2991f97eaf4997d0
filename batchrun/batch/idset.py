"""A set of custom_ids at about 16 bytes each, for duplicate detection over millions of lines."""

from __future__ import annotations

import hashlib

import numpy as np

_MIN_BUFFER = 1 << 15


class IdSet:
    """Keeps 128-bit BLAKE2b digests of the ids (a collision needs ~10^19 ids): most in one sorted
    numpy array, the newest in a small Python set merged into it now and then.

    numpy's fixed-width bytes type drops trailing NUL bytes, so digests are stored without them
    (still one-to-one for fixed-length digests) and compared the same way everywhere.
    """

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype="S16")
        self._recent: set[bytes] = set()

    def __len__(self) -> int:
        return self._sorted.size + len(self._recent)

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest() \
            .rstrip(b"\0")

    def __contains__(self, key: str) -> bool:
        return self._has(self._digest(key))

    def _has(self, d: bytes) -> bool:
        if d in self._recent:
            return True
        s = self._sorted
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
        if len(self._recent) >= max(_MIN_BUFFER, self._sorted.size >> 4):
            self._merge()
        return True

    def _merge(self) -> None:
        new = np.array(list(self._recent), dtype="S16")
        merged = np.concatenate([self._sorted, new])
        merged.sort()
        self._sorted = merged
        self._recent = set()
