"""What the Triton GEMM kernels share: a dot that stays exact under Triton's interpreter.

Triton 3.9's interpreter (TRITON_INTERPRET=1, how the CPU-only suite runs the kernels) returns
garbage from tl.dot on bfloat16 operands, so there the operands are widened to float32 first:
the products of bfloat16 values are exact in float32, so the sums are the ones a GPU's bfloat16
tensor cores accumulate in float32. float32 operands take the IEEE dot (no TF32 rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def dot_mode(dtype: torch.dtype) -> int:
    """The `MODE` constexpr of `dot` for operands of this dtype: 0 native, 1 IEEE float32."""
    if dtype == torch.float32:
        return 1
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    return 0


@triton.jit
def dot(a, b, acc, MODE: tl.constexpr):
    """acc + a @ b, float32 accumulation."""
    if MODE == 1:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(a, b)
