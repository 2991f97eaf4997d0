"""The logits layer of a bfloat16 model on the CPU: bfloat16 weights and inputs, float32 sums and
float32 logits (engine/kernels/bf16_gemm.c through bf16_gemm_linear.py; AMX-BF16 tiles, else
VDPBF16PS on AVX512-BF16, else widened FMAs).

oneDNN's bfloat16 GEMM, as torch calls it, rounds its output to bfloat16: 8 significant bits,
so logits of 16-32 are kept to 0.125 and near-tied tokens swap places. That rounding alone cost
--dtype bfloat16 about 0.9 points of top-1 agreement with float32 on the bundled model
(benchmarks/quality.py); float32 logits from the same bfloat16 GEMM inputs, as llama.cpp's
matmuls give, cost nothing measurable in speed (README, Reduced precision).
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.layers.bf16_gemm_linear import Bf16GemmLinear


class Bf16LogitsLinear(Bf16GemmLinear):
    """The logits layer: float32 output, no bias (no logits layer here has one)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight, None, torch.float32)


def use_float32_logits(model: nn.Module) -> bool:
    """Replace a bfloat16 model's logits linear (model.lm_head, an nn.Linear) by a
    Bf16LogitsLinear; False where there is none to replace."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or head.weight.dtype != torch.bfloat16:
        return False
    model.lm_head = Bf16LogitsLinear(head.weight)
    return True
