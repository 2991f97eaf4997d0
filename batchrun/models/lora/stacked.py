"""One projection's adapter updates stacked by slot, as the batched LoRA kernel reads them
(engine/kernels/triton_lora.py): A^T [adapters, in, R] and B^T [adapters, R, out], R the largest
rank of the stack (the stacked A^T of all targeted slices), zeros elsewhere. Each slice's B^T goes
in at its own rank rows and output columns, so one expand writes every slice of a fused
projection and leaves the columns of untargeted slices as they are (it adds zeros to them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.models.lora.updates import ProjectionUpdate


@dataclass(frozen=True)
class StackedUpdates:
    updates: tuple[ProjectionUpdate, ...]  # by position in the stack (held to tell a change)
    index: dict[int, int]  # slot -> position in the stack
    a_t: torch.Tensor  # [adapters, in, R]
    b_t: torch.Tensor  # [adapters, R, out]

    def current(self, by_slot: dict[int, ProjectionUpdate]) -> bool:
        """Whether these are still the resident adapters' updates of the projection."""
        return (by_slot.keys() == self.index.keys()
                and all(by_slot[s] is self.updates[i] for s, i in self.index.items()))


def stack_updates(by_slot: dict[int, ProjectionUpdate], out_features: int) -> StackedUpdates:
    """by_slot: the resident adapters' updates of one projection (non-empty)."""
    slots = sorted(by_slot)
    updates = tuple(by_slot[s] for s in slots)
    first = updates[0].a_t
    rank = max(u.a_t.shape[1] for u in updates)
    a_t = first.new_zeros(len(updates), first.shape[0], rank)
    b_t = first.new_zeros(len(updates), rank, out_features)
    for i, update in enumerate(updates):
        a_t[i, :, :update.a_t.shape[1]] = update.a_t
        for s in update.slices:
            b_t[i, s.rank_start:s.rank_end, s.out_start:s.out_end] = s.b_t
    return StackedUpdates(updates, {s: i for i, s in enumerate(slots)}, a_t, b_t)


def stacked_segments(segments: list[tuple[int, int, int]],
                     stacked: StackedUpdates, device: torch.device) -> tuple[torch.Tensor, int]:
    """(int32 [G, 3] of (start, end, stack position), the longest one's rows) of the segments
    whose adapter updates this projection."""
    rows = [(start, end, stacked.index[slot]) for start, end, slot in segments
            if slot in stacked.index and end > start]
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(device, non_blocking=True)
    return table, max((end - start for start, end, _ in rows), default=0)
