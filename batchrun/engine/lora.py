"""What the engine needs of LoRA adapters, without knowing what one is.

A request names its adapter (SamplingParams.lora, a string; None = the base model). The engine
is handed an `AdapterSlots` (batchrun.models.lora.LoraManager implements it) and only asks it
which names exist, to make the adapters of the running requests resident (at most max_loras
of them: the scheduler admits no request whose adapter would be one too many), which slot each
is in, and tells it which rows of the next forward pass run on which slot. The prefix cache
keys blocks by adapter (`cache_salt`): the KV of a prompt under one adapter is not the KV of
the same prompt under another.
"""

from __future__ import annotations

import hashlib
from typing import Collection, Protocol, Sequence, runtime_checkable


@runtime_checkable
class AdapterSlots(Protocol):
    max_loras: int

    def known(self, name: str) -> bool:
        """Whether requests may name this adapter."""
        ...

    def activate(self, names: Collection[str]) -> dict[str, str]:
        """Make these adapters (at most max_loras) resident, loading what is not and evicting
        the least recently used others; {name: error} for those that could not be loaded."""
        ...

    def slot_of(self, name: str) -> int:
        """The slot of a resident adapter."""
        ...

    def set_segments(self, segments: Sequence[tuple[int, int, int]]) -> None:
        """(first row, end row, slot) runs of the next forward pass's rows on an adapter;
        rows outside them run on the base model alone. [] after the pass."""
        ...


def cache_salt(adapter: str | None) -> bytes | None:
    """The parent hash of a request's first KV block: None for the base model."""
    if adapter is None:
        return None
    return hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=16).digest()


def segments(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal slot (>= 0) in per-row slots (-1: the base model)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                out.append((start, i, slots[start]))
            start = i
    return out
