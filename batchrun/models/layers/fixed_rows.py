"""--batch-invariant linears: every GEMM runs on slices of exactly ROWS rows.

oneDNN and MKL choose their kernel, blocking and thread split by the GEMM's shape, so the same
input row can come out of GEMMs of different row counts with different last bits (measured
here: a 1-row GEMM takes a GEMV kernel of its own, |diff| ~1e-4 at K=1,536; unpacked F.linear
differs at every row count). Computing every linear as slices of one fixed
shape, the last padded with zero rows, gives each row the same arithmetic whatever the batch:
the K reduction of a fixed-shape call is the same for all its rows, whichever slice or place
in it the row lands in (tests/unit/test_batch_invariant.py checks this on the running machine;
benchmarks/batch_invariant.py measures the cost).
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.layers.packed_linear import PackedLinear

# 16: a decode step of a few sequences pads little (at 64, padding 16 decode rows made the
# 49152-wide logits GEMM 3.6x slower), while 256 prefill rows as 16-row slices cost about what
# one 256-row GEMM does on one thread (SmolLM2's shapes, 2-core AMD EPYC).
ROWS = 16


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
    """Wrap every oneDNN / MKL linear of `model` (packed or not) in FixedRows; returns how many.
    batchrun's own GEMM layers (bf16_gemm_linear.py, int8's) are row-invariant as they are."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, FixedRows):
            continue
        for name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, PackedLinear)):
                setattr(module, name, FixedRows(child))
                count += 1
    return count
