"""A step's state checkpoints (state_checkpoints.py) for a stateful layer that leaves only each
sequence's state after its last row: the step run in pieces that end at the checkpoints.

Pass p takes, of every sequence, its rows from its p-th checkpoint to its (p+1)-th (its first
rows before the first, the rest of its chunk after the last) as a step of its own (a
StepState of those rows, the same slots, fresh only in the first pass), so the layer leaves
each slot holding the state at that sequence's next checkpoint, which is then copied into the
checkpoint's slot. A pass continues from the state the previous one left, so the outputs are
those of one pass over the chunk up to rounding (a chunked form's chunks start at the pieces).
The passes are as many as the most checkpoints one sequence's chunk passes, plus one; the
rows of all of them are the step's rows, each once. A step without checkpoints is not cut.
"""

from __future__ import annotations

from typing import Callable

import torch

from batchrun.engine.state_slots import StepState


def pieces(step: StepState) -> list[tuple[torch.Tensor, StepState, list[int], list[int]]]:
    """Per pass: (the step's rows it takes [T_p], its StepState, and the checkpoints it ends
    at as (sequence slots, checkpoint slots) to copy after it)."""
    starts, counts = step.query_start.tolist(), step.counts.tolist()
    ck = step.checkpoints
    ends = [sorted({r for s, r in zip(ck.seq, ck.rows) if s == i} | {n})
            for i, n in enumerate(counts)]
    slots, fresh = step.slots.tolist(), step.fresh.tolist()
    device = step.slots.device
    out = []
    for p in range(max(len(e) for e in ends)):
        seqs = [i for i, e in enumerate(ends) if len(e) > p]
        lo = [ends[i][p - 1] if p else 0 for i in seqs]
        hi = [ends[i][p] for i in seqs]
        rows = torch.tensor([starts[i] + r for i, a, b in zip(seqs, lo, hi) for r in range(a, b)],
                            dtype=torch.long, device=device)
        # (StepState.of reads a start of 0 as fresh: only a fresh sequence's first piece is)
        piece = StepState.of(step.tensors, [slots[i] for i in seqs],
                             [0 if fresh[i] and not p else 1 for i in seqs],
                             [b - a for a, b in zip(lo, hi)], device)
        end = dict(zip(seqs, hi))
        done = [j for j, (s, r) in enumerate(zip(ck.seq, ck.rows)) if end.get(s) == r]
        out.append((rows, piece, [slots[ck.seq[j]] for j in done], [ck.slots[j] for j in done]))
    return out


def run(step: StepState, tensors: tuple[torch.Tensor, ...],
        forward: Callable[[torch.Tensor, StepState], torch.Tensor]) -> torch.Tensor:
    """The layer's outputs [T, ...] for the whole step, `forward(rows, piece)` giving those of
    the step's rows `rows` run as the step `piece` (and updating the slots of `tensors`, the
    layer's state); each checkpoint's slot of `tensors` gets its sequence's state. For a step
    with checkpoints (without, the layer runs the step as it is)."""
    total = int(step.query_start[-1])
    out: torch.Tensor | None = None
    for rows, piece, src, dst in pieces(step):
        part = forward(rows, piece)
        if out is None:
            out = part.new_empty((total, *part.shape[1:]))
        out[rows] = part
        if dst:
            for t in tensors:
                t[dst] = t[src]
    assert out is not None
    return out

