"""Per-request recurrent state beside the paged KV cache: convolution and SSM (or linear
attention) state of a fixed size per sequence, whatever its length.

A model that keeps such state declares it (`StateSpec`: each stateful layer's tensors, their
shapes and dtypes, one slot's worth); the engine knows nothing else about it. The KV cache
manager (kv_cache.py) hands a running sequence one slot from `StateSlots` when it first
allocates for it and takes it back with its blocks (finish, preemption: a preempted sequence
recomputes its prompt into a fresh slot). The runner holds the state tensors ([slots, *shape]
per declared tensor) and hands the model each step's `StepState`: which slot each sequence of
the step owns, and which start from no state (their first chunk). A model whose stateful
layers can also save their state at offsets inside a chunk (`StateSpec.checkpoints`) gets
prefix caching through state checkpoints (state_checkpoints.py); for any other it is off: a
cached block's KV does not give back the state at its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from batchrun.engine.state_checkpoints import StepCheckpoints


@dataclass(frozen=True)
class StateTensor:
    shape: tuple[int, ...]  # one sequence's
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateSpec:
    """Each stateful layer's state tensors (a Mamba mixer: its convolution and SSM state)."""
    layers: tuple[tuple[StateTensor, ...], ...]
    # Every stateful layer writes a step's StepState.checkpoints (its state after given rows of
    # a sequence's chunk, state_checkpoints.py): the model can take prefix-cache hits.
    checkpoints: bool = False

    @property
    def bytes_per_sequence(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer)


class StateSlots:
    """The pool of slot ids (the tensors themselves live in the runner)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest first
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        slot = self.free.pop()
        self.peak_used = max(self.peak_used, self.num_slots - len(self.free))
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)


def state_tensors(spec: StateSpec, num_slots: int, device: torch.device
                  ) -> list[tuple[torch.Tensor, ...]]:
    """Each stateful layer's tensors, [num_slots, *shape] each."""
    return [tuple(torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=device)
                  for t in layer) for layer in spec.layers]


def copy_slot(tensors: list[tuple[torch.Tensor, ...]], src: int, dst: int) -> None:
    """A forked sequence's state: src's slot copied into dst's."""
    for layer in tensors:
        for t in layer:
            t[dst] = t[src]


@dataclass
class StepState:
    """What a stateful model reads of one step: sequence i (in row order) owns rows
    query_start[i]:query_start[i + 1] and state slot slots[i]; fresh[i]: it has no state yet
    (its first chunk), so whatever its slot holds is not read. `checkpoints`: the states to save
    after given rows of a sequence's chunk, into further slots of the same tensors."""
    tensors: list[tuple[torch.Tensor, ...]]  # per stateful layer: [slots, *shape] each
    slots: torch.Tensor  # [S] long
    fresh: torch.Tensor  # [S] bool
    query_start: torch.Tensor  # [S + 1]
    counts: torch.Tensor  # [S] rows of each sequence
    max_count: int
    checkpoints: StepCheckpoints = field(default_factory=StepCheckpoints)

    @classmethod
    def of(cls, tensors: list[tuple[torch.Tensor, ...]], slots: list[int], starts: list[int],
           counts: list[int], device: torch.device,
           checkpoints: StepCheckpoints | None = None) -> StepState:
        count_t = torch.tensor(counts, device=device)
        return cls(tensors, torch.tensor(slots, dtype=torch.long, device=device),
                   torch.tensor([s == 0 for s in starts], device=device),
                   torch.cat([count_t.new_zeros(1), torch.cumsum(count_t, 0)]), count_t,
                   max(counts), checkpoints or StepCheckpoints())

    def padded_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([S, L] row index, [S, L] valid) of the step's rows laid out one sequence per row,
        L = the longest sequence's count (padding points at row 0 and is not valid)."""
        offsets = torch.arange(self.max_count, device=self.counts.device)
        valid = offsets[None, :] < self.counts[:, None]
        rows = torch.where(valid, self.query_start[:-1, None] + offsets[None, :], 0)
        return rows, valid
