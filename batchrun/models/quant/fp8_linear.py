"""float8 (e4m3) linear layers.

Fp8WeightLinear: float8 weights with float activations, as an FP8 checkpoint stores them. The
CPU has no float8 arithmetic: the weights stay float8 bytes (1 byte a weight, as in the
checkpoint) with their scales, and each step dequantises this layer's weights for one dense
GEMM in the activations' dtype, as int4-weight's larger steps do. In float32 the dequantised
weights are the checkpoint's reference dequantisation exactly (a float8 value times a float32
scale). On CUDA the Triton weight-only GEMM dequantises them in-kernel, the same way.

Fp8Linear (--quantization fp8): float8 weights per output channel and float8 activations per
token (dynamic), y = (q_x @ q_w^T) * s_x * s_w (+ bias). On CUDA the Triton scaled GEMM
(float8 tensor-core dots on sm_89+); on the CPU an emulation with the same values (the float8
products are exact in float32, the sums float32's)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.models.quant.on_device import DeviceTensors, runs_triton


def row_scales(scale: torch.Tensor, out_features: int, in_features: int,
               block: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
    """(scale [N, G] float32, the G column blocks' width) of a per-tensor ([1] or []), per
    channel ([N] or [N, 1]) or block-wise ([ceil(N/bn), ceil(K/bk)] for `block` (bn, bk)) scale."""
    scale = scale.float()
    if block is not None and scale.shape == (-(-out_features // block[0]), -(-in_features // block[1])):
        return scale.repeat_interleave(block[0], dim=0)[:out_features].contiguous(), block[1]
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(out_features, 1).contiguous(), in_features
    if scale.numel() == out_features:
        return scale.reshape(out_features, 1).contiguous(), in_features
    raise ValueError(f"an FP8 weight scale of shape {tuple(scale.shape)} for a "
                     f"{out_features}x{in_features} weight (block {block})")


class Fp8WeightLinear(DeviceTensors):
    DEVICE_TENSORS = ("fp8", "scale", "bias")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                 fp8: torch.Tensor, scale: torch.Tensor, block: int):
        super().__init__()
        self.out_features, self.in_features = fp8.shape
        self.fp8 = fp8.contiguous()
        self.scale, self.block = scale.float().contiguous(), block  # [N, ceil(K/block)]
        self.bias = None if bias is None else bias.detach().float()

    @staticmethod
    def nbytes(out_features: int, in_features: int, block: int) -> int:
        """A byte a weight, a float32 scale per row and block of `block` columns."""
        return out_features * in_features + out_features * math.ceil(in_features / block) * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        dtype = x.dtype
        x2 = x.reshape(-1, self.in_features)
        if runs_triton(x2.device):
            from batchrun.engine.kernels.triton_weight_gemm import weight_gemm

            y = weight_gemm(x2, self.fp8, self.scale, self.block)
        else:
            y = F.linear(x2, self.dequantized_weight(dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.fp8.shape
        w = self.fp8.to(torch.float32)
        if k % self.block == 0:
            w = (w.reshape(n, k // self.block, self.block) * self.scale[..., None]).reshape(n, k)
        else:
            w = w * self.scale.repeat_interleave(self.block, dim=1)[:, :k]
        return w.to(dtype)


def fp8_layer(fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
    """An FP8 projection as checkpoint.Layer: scales per row (so q/k/v fuse)."""
    from batchrun.models.quant.checkpoint import Layer

    if fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weights of dtype {fp8.dtype}: batchrun reads float8_e4m3fn")
    rows, width = row_scales(scale, fp8.shape[0], fp8.shape[1], block)
    return Layer(Fp8WeightLinear, {"fp8": fp8, "scale": rows}, {"block": width})


class Fp8Linear(DeviceTensors):
    """W8A8 float8: per-channel float8 weights, per-token dynamic float8 activations."""

    DEVICE_TENSORS = ("fp8", "w_scale", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        from batchrun.engine.kernels.triton_scaled_gemm import quantize_channels_fp8

        self.out_features, self.in_features = weight.shape
        self.fp8, self.w_scale = quantize_channels_fp8(weight.detach())
        self.bias = None if bias is None else bias.detach().float().to(weight.device)

    @staticmethod
    def nbytes(out_features: int, in_features: int) -> int:
        return out_features * in_features + out_features * 4  # float8 weights, float32 scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from batchrun.engine.kernels.triton_scaled_gemm import quantize_rows_fp8, scaled_gemm

        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        qx, x_scale = quantize_rows_fp8(x2)
        if runs_triton(x2.device):
            y = scaled_gemm(qx, self.fp8, x_scale, self.w_scale, self.bias)
        else:
            y = (qx.float() @ self.fp8.float().T) * x_scale[:, None] * self.w_scale
            if self.bias is not None:
                y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.fp8.float() * self.w_scale[:, None]
