"""bfloat16 linears on batchrun's own GEMM (engine/kernels/bf16_gemm.c): weights packed once in
its layout, float32 sums, the output float32 or rounded to bfloat16 once.

On a CPU with AMX-BF16 every linear of a bfloat16 model runs here instead of oneDNN: as fast or
faster at every row count but around 131 (`python benchmarks/bf16_gemms.py`), and each row's
result is the same bits whatever else is in the GEMM (the kernel's path depends on the CPU and
k, never on the rows), so `--batch-invariant` costs these layers nothing and a prefix-cache hit
cannot move a bfloat16 answer through them. The logits layer (bf16_logits.py) keeps float32
output on every CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 16  # output columns a block of the packed layout (bf16_gemm.c's CB)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] as bf16_gemm.c reads it: blocks of 16 output columns, and in each, for every
    input pair (2i, 2i + 1), the 16 columns' two weights side by side (n and k padded with
    zeros); int32 lanes of two bfloat16."""
    n, k = weight.shape
    blocks, pairs = -(-n // BLOCK), -(-k // 2)
    w = F.pad(weight.detach().to(torch.bfloat16), (0, 2 * pairs - k, 0, blocks * BLOCK - n))
    lanes = w.view(blocks, BLOCK, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return lanes.view(torch.int32).view(-1)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse: the bfloat16 weight [n, k]."""
    blocks, pairs = -(-n // BLOCK), -(-k // 2)
    lanes = packed.view(torch.bfloat16).view(blocks, pairs, BLOCK, 2)
    return lanes.permute(0, 2, 1, 3).reshape(blocks * BLOCK, 2 * pairs)[:n, :k].contiguous()


class Bf16GemmLinear(nn.Module):
    """x [..., k] -> [..., n] of out_dtype through bf16_gemm.c once `kernels` (the CPU kernel
    library) is attached; bias float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_dtype = out_dtype
        self.kernels = None  # attached by the loader (attach_all); the layer needs them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        assert self.kernels is not None  # this layer is made only where the kernels run
        out = self.kernels.bf16_gemm(rows, self.packed, self.out_features, self.bias, self.out_dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bf16(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features, self.in_features)


def use_for_linears(model: nn.Module) -> int:
    """Replace every bfloat16 nn.Linear of `model` by a Bf16GemmLinear; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(module, name, Bf16GemmLinear(child.weight, child.bias))
                count += 1
    return count


def attach_all(model: nn.Module, cpu_kernels, float_linear, keep_without_amx: bool) -> None:
    """Give the model's Bf16GemmLinear layers the kernel library. Where it has no AMX tiles they
    become float_linear(weight, bias) (oneDNN's packed bfloat16 linear), unless keep_without_amx
    (--batch-invariant: the kernel's vector path is row-invariant too); a layer with float32
    output (the logits), which oneDNN does not give, stays unless there is no library at all."""
    tiles = cpu_kernels is not None and cpu_kernels.bf16_gemm_amx()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, Bf16GemmLinear):
                continue
            float_out = child.out_dtype == torch.float32
            if cpu_kernels is not None and (tiles or keep_without_amx or float_out):
                child.kernels = cpu_kernels
            else:
                bias = None if child.bias is None else child.bias.to(torch.bfloat16)
                setattr(module, name, float_linear(child.weight_bf16(), bias))
