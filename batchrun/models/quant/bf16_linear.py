"""bfloat16 GEMMs inside a float32 model: weights in bfloat16 (packed for oneDNN, which runs
them on AMX-BF16 / AVX512-BF16), each linear's input rounded to bfloat16, float32 accumulation
and output. Unlike --dtype bfloat16 the residual stream, norms, attention and KV cache stay
float32 (and on the fused C kernels' float32 path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROWS_HINT = 64  # as packed_linear's


class Bf16Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().to(torch.bfloat16).contiguous()
        # packed once for oneDNN as packed_linear.PackedLinear does (which imports this package)
        self.weight_bf16: torch.Tensor | None = None  # without a packed weight: the plain one
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        except (RuntimeError, AttributeError):  # a torch build without oneDNN
            self.packed, self.weight_bf16 = None, w
        self.bias = None if bias is None else bias.detach().float()

    @staticmethod
    def nbytes(out_features: int, in_features: int) -> int:
        return out_features * in_features * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        y = F.linear(xb, self.weight_bf16) if self.weight_bf16 is not None else \
            torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        if self.weight_bf16 is not None:
            return self.weight_bf16.float()
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)  # exact: one weight per output
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").float().T.contiguous()
