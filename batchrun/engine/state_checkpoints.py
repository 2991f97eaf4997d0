"""Prefix caching for models with recurrent state: the state at block boundaries, kept beside
the cached blocks.

A cached block gives back its K/V but not the state of the stateful layers at its end, so a
prefix hit of such a model must end where that state was saved. While a sequence's prefill
passes a checkpoint boundary (every `interval` tokens, a multiple of the KV block size), the
model writes the state of every stateful layer at that offset of its chunk into a checkpoint
slot (`StepCheckpoints`, carried in StepState; the mixers write it), keyed by the chained hash
of the block that ends there — the hash the prefix cache keys that block by. A new sequence
whose prompt hits the prefix cache takes the longest hit that ends at a checkpoint, copies the
checkpoint into its own state slot and starts its prefill there.

Checkpoint slots are extra rows of the runner's state tensors (after the sequences' slots), so
a checkpoint is written and read as any slot is. The pool is bounded (kv_sizing pays for it
from the KV budget) and evicts the least recently used checkpoint. A checkpoint is planned
when its step is scheduled and becomes a hit only once that step has run (`commit`, when the
sequence's blocks are cached): until then no sequence may start from it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

# Tokens between checkpoints, by default (benchmarks/hybrid_prefix.py measured 16 / 64 / 256;
# rounded down to a multiple of the KV block size, at least one block).
CHECKPOINT_TOKENS = 64


@dataclass
class StepCheckpoints:
    """The states one step saves: checkpoint j is sequence seq[j]'s state (in the step's row
    order) after the first rows[j] rows of its chunk (1 <= rows[j] <= its count), written into
    slot slots[j] of the state tensors. Sorted by sequence, then rows."""
    seq: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.slots)

    def at_row(self, row: int) -> tuple[list[int], list[int]]:
        """(sequences, slots) of the checkpoints taken after `row` + 1 rows."""
        hits = [j for j, r in enumerate(self.rows) if r == row + 1]
        return [self.seq[j] for j in hits], [self.slots[j] for j in hits]

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq, rows, slots) as long tensors."""
        return tuple(torch.tensor(v, dtype=torch.long, device=device)  # type: ignore[return-value]
                     for v in (self.seq, self.rows, self.slots))


class CheckpointPool:
    """Checkpoint slots keyed by block hash, least recently used first."""

    def __init__(self, first_slot: int, num_slots: int, interval: int):
        self.num_slots = num_slots
        self.interval = interval  # tokens between checkpoints (a multiple of the block size)
        self.free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.ready: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.pending: dict[bytes, int] = {}  # written by a step that has not run yet
        self.hits = 0

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of a written checkpoint (now the most recently used), or None."""
        slot = self.ready.get(block_hash)
        if slot is not None:
            self.ready.move_to_end(block_hash)
        return slot

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.ready

    def plan(self, block_hash: bytes) -> int | None:
        """A slot for the checkpoint of `block_hash` a step is about to write; None when one
        is kept or planned already, or every slot is pending."""
        if block_hash in self.ready or block_hash in self.pending:
            return None
        if not self.free:
            if not self.ready:
                return None
            _, slot = self.ready.popitem(last=False)
            self.free.append(slot)
        slot = self.free.pop()
        self.pending[block_hash] = slot
        return slot

    def commit(self, block_hash: bytes) -> None:
        """The step that writes `block_hash`'s checkpoint has run: a hit from now on."""
        slot = self.pending.pop(block_hash, None)
        if slot is not None:
            self.ready[block_hash] = slot

    def cancel(self, block_hash: bytes) -> None:
        """A planned checkpoint that will not be written (its sequence went away)."""
        slot = self.pending.pop(block_hash, None)
        if slot is not None:
            self.free.append(slot)

    def drop(self, block_hash: bytes) -> None:
        """Forget a written checkpoint (its block left the prefix cache)."""
        slot = self.ready.pop(block_hash, None)
        if slot is not None:
            self.free.append(slot)

    def clear(self) -> None:
        for block_hash in list(self.ready):
            self.drop(block_hash)
