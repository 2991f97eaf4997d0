"""The ops with a PyTorch path too: each takes `kernels` (the loaded ops.CpuKernels, or None
where there is no library) and runs the C kernel where it serves, else PyTorch's ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.kernels.ops import CpuKernels

_TINY = 1e-12  # an all-zero row's quantization scale instead of 0 (its int8 values are all 0)
_KERNEL_MAX_COLS = 4096  # quantize.c's row buffer for bfloat16 input


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernels: CpuKernels | None = None) -> torch.Tensor:
    """residual += x in place (x None: nothing added) and the RMS norm of the sum."""
    if kernels is not None:
        return kernels.add_rms_norm(x, residual, weight, eps)
    if x is not None:
        residual.add_(x)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             kernels: CpuKernels | None = None) -> torch.Tensor:
    """The RMS norm of x (the kernel's: in place, in the weight's dtype)."""
    if kernels is not None:
        return kernels.rms_norm_(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gated_mul(gate_up: torch.Tensor, activation: str = "silu",
              kernels: CpuKernels | None = None) -> torch.Tensor:
    """act(gate) * up of rows [gate | up], act SiLU (SwiGLU) or GELU with the tanh approximation
    (activation "gelu_tanh": GeGLU)."""
    gelu = activation == "gelu_tanh"
    if kernels is not None:
        return kernels.gelu_tanh_mul(gate_up) if gelu else kernels.silu_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def softcap_(logits: torch.Tensor, cap: float, kernels: CpuKernels | None = None) -> torch.Tensor:
    """logits = cap * tanh(logits / cap) in place (float32)."""
    if kernels is not None and logits.is_contiguous():
        return kernels.softcap_(logits, cap)
    return logits.div_(cap).tanh_().mul_(cap)


def quantize_rows(x: torch.Tensor, kernels: CpuKernels | None = None, unsigned: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8: (int8 [M, K], float32 scales [M, 1]) of a float [M, K], each row
    round(x / s) with s = max|x| / 127; with `unsigned` the same values as uint8 q + 128 (zero
    point 128), the input oneDNN's VNNI int8 GEMM takes."""
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16) and (
            x.dtype == torch.float32 or x.shape[1] <= _KERNEL_MAX_COLS):
        return kernels.quantize_rows(x.contiguous(), unsigned)
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY).div_(127.0)
    q = torch.round(x / scale).to(torch.int8)
    return (q.view(torch.uint8).bitwise_xor(0x80) if unsigned else q), scale


def outlier_columns(x: torch.Tensor, outliers: torch.Tensor) -> torch.Tensor:
    """Columns `outliers` of x as bfloat16 [M, n rounded up to even] (an odd n's last column 0):
    the outlier channels' operand of rescale_rows, as quantize_rows_split's kernel writes it."""
    cols = x.index_select(1, outliers).to(torch.bfloat16)
    return F.pad(cols, (0, len(outliers) % 2))


def outlier_pairs(part: torch.Tensor) -> torch.Tensor:
    """float [n, N] weight rows of the outlier channels -> bfloat16 [ceil(n / 2), N, 2]: channels
    2j and 2j + 1 side by side for each output column (one VDPBF16PS lane), an odd n padded with
    a zero row."""
    part = F.pad(part.to(torch.bfloat16), (0, 0, 0, part.shape[0] % 2))
    return part.reshape(-1, 2, part.shape[1]).transpose(1, 2).contiguous()


def pairs_matrix(pairs: torch.Tensor) -> torch.Tensor:
    """outlier_pairs back to float32 [n rounded up to even, N]."""
    return pairs.transpose(1, 2).reshape(-1, pairs.shape[1]).float()


def quantize_rows_split(x: torch.Tensor, mult: torch.Tensor, outliers: torch.Tensor,
                        kernels: CpuKernels | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 q + 128 and scales of x * mult as quantize_rows(unsigned=True) gives them,
    outlier_columns(x, outliers)): a smoothed Int8Linear's input in one pass. mult float32 [K],
    outliers int64 [n]."""
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16) \
            and x.shape[1] <= _KERNEL_MAX_COLS:
        return kernels.quantize_rows_split(x.contiguous(), mult, outliers)
    q, scale = quantize_rows(x.float() * mult, kernels, unsigned=True)
    return q, scale, outlier_columns(x, outliers)


def rescale_rows(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 kernels: CpuKernels | None = None, x_out: torch.Tensor | None = None,
                 pairs: torch.Tensor | None = None) -> None:
    """y[i] = y[i] * scale[i] (+ bias) (+ x_out[i] @ pairs_matrix(pairs): the outlier channels'
    bfloat16 GEMM, float32 sums; x_out from outlier_columns, pairs from outlier_pairs), float32
    [M, N] in place; with the kernels one pass over y."""
    if kernels is not None and y.is_contiguous() and y.dtype == torch.float32:
        kernels.scale_rows_(y, scale, bias, x_out, pairs)
        return
    y.mul_(scale)
    if bias is not None:
        y.add_(bias)
    if x_out is not None:
        assert pairs is not None  # the outlier columns come with their weight pairs
        y.addmm_(x_out.float(), pairs_matrix(pairs))
