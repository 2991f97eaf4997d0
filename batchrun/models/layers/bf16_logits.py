"""The logits layer of a bfloat16 model on the CPU: bfloat16 weights and inputs, float32 sums and
float32 logits (engine/kernels/bf16_gemm.c; VDPBF16PS on AVX512-BF16, widened FMAs elsewhere).

oneDNN's bfloat16 GEMM, as torch calls it, rounds its output to bfloat16: 8 significant bits,
so logits of 16-32 are kept to 0.125 and near-tied tokens swap places. That rounding alone cost
--dtype bfloat16 about 0.9 points of top-1 agreement with float32 on the bundled model
(benchmarks/quality.py); float32 logits from the same bfloat16 GEMM inputs, as llama.cpp's
matmuls give, cost nothing measurable in speed (README, Reduced precision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.kernels.ops import CpuKernels

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


class Bf16LogitsLinear(nn.Module):
    """x [..., k] -> float32 [..., n] through bf16_gemm.c once `kernels` (the CPU kernel
    library) is attached; no bias (no logits layer here has one)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight)
        self.kernels: CpuKernels | None = None  # attached by the loader (the layer needs it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        assert self.kernels is not None  # this layer is made only where the kernels run
        out = self.kernels.bf16_gemm(rows, self.packed, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bf16(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features, self.in_features)


def use_float32_logits(model: nn.Module) -> bool:
    """Replace a bfloat16 model's logits linear (model.lm_head, an nn.Linear) by a
    Bf16LogitsLinear; False where there is none to replace."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or head.weight.dtype != torch.bfloat16:
        return False
    model.lm_head = Bf16LogitsLinear(head.weight)
    return True


def attach(model: nn.Module, cpu_kernels, float_linear) -> None:
    """Give the logits layer the kernel library; without one (no compiler), it becomes
    float_linear(weight, None) (a packed oneDNN linear: bfloat16 logits, as before)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, Bf16LogitsLinear):
        return
    if cpu_kernels is None:
        model.lm_head = float_linear(head.weight_bf16(), None)
    else:
        head.kernels = cpu_kernels
