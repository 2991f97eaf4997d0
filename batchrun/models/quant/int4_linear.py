"""int4 weights with float activations: weights in groups along the input (GROUP when quantized
here; a checkpoint's own size when loaded from GPTQ / AWQ / compressed-tensors), each
w = q * scale + min with q in 0..15 (GGUF Q4_1's form; Q4_0 is min = -8 * scale; a zero point z
is min = -z * scale).

The nibbles live once, in the layout of torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu,
which computes (q - 8) * s + z: s = scale, z = min + 8 * scale); that kernel runs a few rows
of bfloat16 activations, and larger steps (and float32 activations, which it runs without
vector code) dequantize this layer's weights for one dense GEMM, in the activations' dtype
(float32: exact to the dequantised weights; bfloat16 under --dtype bfloat16). Moved to CUDA,
the layer runs the Triton weight-only GEMM (engine/kernels/triton_int4_gemm.py) on the same
nibbles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.models.quant.int8_linear import WEIGHT_ONLY_KERNEL_ROWS
from batchrun.models.quant.on_device import runs_triton

GROUP = 32
KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
_BLOCK_N = 64  # the CPU kernel's packing: per 64 output rows, byte j of input k holds rows j, j+32


def quantize_groups(weight: torch.Tensor, group: int = GROUP):
    """(q uint8 [N, K] in 0..15, scale [N, K/group], min [N, K/group]), asymmetric per group."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, lo


def pack(q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(packed nibbles [N, K/2] uint8, whether they are in the CPU kernel's layout)."""
    n, k = q.shape
    if n % _BLOCK_N == 0 and q.device.type == "cpu" and hasattr(
            torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):  # elsewhere: plain
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            if packed.shape == (n, k // 2) and torch.equal(unpack(packed, True), q):
                return packed, True
        except RuntimeError:
            pass
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), False


def unpack(packed: torch.Tensor, kernel_layout: bool) -> torch.Tensor:
    """q uint8 [N, K] back from pack()'s bytes."""
    n, half = packed.shape
    lo, hi = packed & 15, packed >> 4
    if not kernel_layout:
        return torch.stack((lo, hi), dim=-1).reshape(n, 2 * half)
    k = 2 * half
    blocks = torch.cat((lo.reshape(n // _BLOCK_N, k, _BLOCK_N // 2),
                        hi.reshape(n // _BLOCK_N, k, _BLOCK_N // 2)), dim=2)  # [B, K, 64]
    return blocks.transpose(1, 2).reshape(n, k)


class Int4WeightLinear(nn.Module):
    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, *,
                 q: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 minimum: torch.Tensor | None = None, group: int = GROUP,
                 in_perm: torch.Tensor | None = None):
        """`in_perm`: the nibbles' columns are the inputs in this order (GPTQ act-order, its
        groups contiguous once the inputs are sorted by group); the layer gathers x by it."""
        super().__init__()
        if weight is not None:
            if weight.shape[1] % group:
                raise ValueError(f"int4 weights need input features divisible by {group}, "
                                 f"not {weight.shape[1]}")
            q, scale, minimum = quantize_groups(weight, group)
        # else a checkpoint's nibbles with their scales and minima
        assert q is not None and scale is not None and minimum is not None
        self.out_features, self.in_features = q.shape
        self.group = group
        self.packed, self.kernel_layout = pack(q)
        self.scale, self.minimum = scale.float().contiguous(), minimum.float().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        self.in_perm = None if in_perm is None else in_perm.long().contiguous()
        self._kernel_scales: torch.Tensor | None = None

    @staticmethod
    def nbytes(out_features: int, in_features: int, group: int = GROUP) -> int:
        """Bytes one layer holds: two weights a byte, a float32 scale and min per group (the
        kernel's bfloat16 copy of them, made on first use, and an act-order in_perm, 8 bytes an
        input, not counted)."""
        return out_features * in_features // 2 + out_features * (in_features // group) * 8

    def _apply(self, fn, recurse=True):
        """The nibbles, scales and minima (plain attributes, so that a cast of the model leaves
        them as they are) follow the module to another device, keeping their dtypes."""
        device = fn(torch.empty(0, device=self.packed.device)).device
        if device != self.packed.device:
            for name in ("packed", "scale", "minimum", "bias", "in_perm"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name).to(device))
            self._kernel_scales = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_triton(self.packed.device):
            return self._forward_cuda(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        dtype = x.dtype
        x2 = x2.to(dtype)
        if self.in_perm is not None:
            x2 = x2.index_select(1, self.in_perm)
        if (self.kernel_layout and dtype == torch.bfloat16 and self.group in KERNEL_GROUPS
                and 0 < x2.shape[0] <= WEIGHT_ONLY_KERNEL_ROWS):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group,
                                                           self._scales_and_zeros())
        else:
            y = F.linear(x2, self._grouped_weight(dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton weight-only GEMM, dequantising in-kernel, in the activations' dtype."""
        from batchrun.engine.kernels.triton_int4_gemm import int4_gemm

        x2 = x.reshape(-1, self.in_features)
        if self.in_perm is not None:
            x2 = x2.index_select(1, self.in_perm)
        y = int4_gemm(x2, self.packed, self.scale, self.minimum, self.group, self.kernel_layout)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights over the inputs in their own order."""
        w = self._grouped_weight(dtype)
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out

    def _grouped_weight(self, dtype: torch.dtype) -> torch.Tensor:
        q = unpack(self.packed, self.kernel_layout).to(dtype)
        n, k = q.shape
        q = q.reshape(n, k // self.group, self.group)
        w = q * self.scale.to(dtype)[..., None] + self.minimum.to(dtype)[..., None]
        return w.reshape(n, k)

    def _scales_and_zeros(self) -> torch.Tensor:
        if self._kernel_scales is None:  # [K/group, N, 2] of (s, z), bfloat16 like the activations
            zero = self.minimum + 8 * self.scale
            self._kernel_scales = torch.stack((self.scale.T, zero.T), dim=-1).to(torch.bfloat16).contiguous()
        return self._kernel_scales
