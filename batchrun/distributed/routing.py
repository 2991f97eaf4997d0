"""Which replica a request goes to: cache-aware, with load balance.

Every replica remembers (bounded, least recently used first out) the chained hashes of the full
KV blocks of the prompts it was sent: what its prefix cache may hold. A request goes to the
replica whose remembered blocks match the longest prefix of its prompt, unless that replica has
clearly more open requests than the least loaded one (more than `slack` x its load + 8): then
to the least loaded. A prefix every prompt shares (a chat template's system prompt) matches
everywhere, so load decides; a long shared prefix (a few-shot block) keeps its requests on the
replica that computed it.

A prompt with images has its blocks keyed by the images' content hashes too (`images_key`): all
images share the placeholder token ids, so without it prompts about different pictures would look
alike and pile onto one replica. The key covers every block of such a prompt (the driver does not
know where the placeholders sit), so the same picture under the same prompt goes where it went
before and a text prefix in front of an image is not matched across different images.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

BLOCK = 16  # the engine's KV block size: the cache shares whole blocks


def images_key(multimodal: Any) -> bytes:
    """The content hashes of a request's images (engine.multimodal.MultiModalInputs), b"" for
    text only."""
    if multimodal is None:
        return b""
    return b"".join(image.content_hash for image in multimodal.images)


def block_hashes(prompt: Sequence[int], block: int = BLOCK, key: bytes = b"") -> list[int]:
    """Chained hashes of the prompt's full blocks (block i's identity covers blocks 0..i),
    each mixing in `key`."""
    out, parent = [], hash(key) if key else 0
    for start in range(0, len(prompt) - block + 1, block):
        parent = hash((parent, tuple(prompt[start:start + block])))
        out.append(parent)
    return out


class PrefixRouter:
    def __init__(self, replicas: int, capacity: int = 1 << 16, slack: float = 1.25):
        self.capacity, self.slack = capacity, slack
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.load = [0] * replicas  # open requests per replica

    def _match(self, index: int, hashes: list[int]) -> int:
        seen, n = self.seen[index], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def choose(self, prompt: Sequence[int], key: bytes = b"") -> int:
        hashes = block_hashes(prompt, key=key)
        least = min(range(len(self.load)), key=self.load.__getitem__)
        best = max(range(len(self.load)), key=lambda i: (self._match(i, hashes), -self.load[i]))
        index = best if self.load[best] <= self.slack * self.load[least] + 8 else least
        seen = self.seen[index]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        self.load[index] += 1
        return index

    def done(self, index: int) -> None:
        self.load[index] -= 1

    def forget(self, index: int) -> None:
        """A replaced replica starts with an empty cache."""
        self.seen[index].clear()
