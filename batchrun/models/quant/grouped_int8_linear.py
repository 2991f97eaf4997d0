"""int8 weights in groups along the input, float activations: w = q * scale (+ min) per group
of 16 or 32. The exact form of GGUF's Q8_0 (int8, groups of 32), Q5_K (0..31 with a min, 32)
and Q6_K (-32..31, 16); the weights stay one byte each.

Up to KERNEL_ROWS rows (decode) run the C kernel (engine/kernels/grouped_int8.c), which widens the int8
weights a vector at a time; more rows (prefill), or no kernel library, dequantize this layer's
weights for one dense GEMM in the activations' dtype (float32: exact).
`python benchmarks/grouped_int8.py` measures both ways side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.kernels.ops import CpuKernels

# Up to this many rows the kernel beats dequantize + GEMM (benchmarks/grouped_int8.py, one
# thread, SmolLM2's shapes: 2.6-3.3x float32 at 1 row, even at 16, dequantize + GEMM 1.6-2.2x at 256).
KERNEL_ROWS = 16


class GroupedInt8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 group: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        groups = (self.out_features, self.in_features // group)
        if group % 16 or self.in_features % group or tuple(scale.shape) != groups:
            raise ValueError(f"grouped int8 weights: group {group} for {tuple(q.shape)} with "
                             f"scales {tuple(scale.shape)}")
        self.group = group
        self.qweight = q.to(torch.int8).contiguous()
        self.scale = scale.float().contiguous()
        self.minimum = None if minimum is None else minimum.float().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        self.kernels: CpuKernels | None = None  # the CPU kernel library, once built (int8_linear.attach_kernels)

    @staticmethod
    def nbytes(out_features: int, in_features: int, group: int = 32, has_min: bool = True) -> int:
        """Bytes one layer holds: a byte a weight, a float32 scale (and min) per group."""
        return out_features * in_features + out_features * (in_features // group) * 4 * (1 + has_min)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if (self.kernels is not None and 0 < x2.shape[0] <= KERNEL_ROWS
                and x.dtype in (torch.float32, torch.bfloat16)):
            y = self.kernel_forward(x2)
        else:
            dtype = x.dtype
            y = F.linear(x2.to(dtype), self.dequantized_weight(dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def kernel_forward(self, x2: torch.Tensor) -> torch.Tensor:
        assert self.kernels is not None  # forward calls it only then
        return self.kernels.grouped_int8_linear(x2, self.qweight, self.scale, self.minimum,
                                                self.group)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.qweight.shape
        q = self.qweight.to(dtype).reshape(n, k // self.group, self.group)
        w = q * self.scale.to(dtype)[..., None]
        if self.minimum is not None:
            w = w + self.minimum.to(dtype)[..., None]
        return w.reshape(n, k)
