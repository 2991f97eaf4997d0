"""--batch-invariant linears: every GEMM runs on slices of exactly ROWS rows.

oneDNN and MKL choose their kernel, blocking and thread split by the GEMM's shape, so the same
input row summed in a GEMM of 7 rows and in one of 64 can differ in the last bits (and a
1-row GEMM takes a GEMV kernel of its own). Computing every linear as slices of one fixed
shape, the last padded with zero rows, gives each row the same arithmetic whatever the batch:
the K reduction of a fixed-shape call is the same for all its rows, whichever slice or place
in it the row lands in (tests/unit/test_batch_invariant.py checks this on the running machine;
benchmarks/batch_invariant.py measures the cost).
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.packed_linear import ROWS_HINT, PackedLinear

ROWS = ROWS_HINT  # the shape oneDNN's packed layout is tuned for


class FixedRows(nn.Module):
    """`inner` (a linear layer) applied ROWS rows at a time."""

    def __init__(self, inner: nn.Module, rows: int = ROWS):
        super().__init__()
        self.inner = inner
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        count, rows = flat.shape[0], self.rows
        pad = -count % rows
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
        out = torch.cat([self.inner(flat[i:i + rows]) for i in range(0, count + pad, rows)])
        return out[:count].reshape(*x.shape[:-1], out.shape[-1])


@torch.no_grad()
def fix_rows(model: nn.Module) -> int:
    """Wrap every linear of `model` (packed or not) in FixedRows; returns how many."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, FixedRows):
            continue
        for name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, PackedLinear)):
                setattr(module, name, FixedRows(child))
                count += 1
    return count
