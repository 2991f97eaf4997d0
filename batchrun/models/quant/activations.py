"""Per-token dynamic int8 quantization of activations: each row x[i] becomes
round(x[i] / s[i]) with s[i] = max|x[i]| / 127, so every token uses the int8 range fully.
With the CPU kernel library (engine/kernels/quantize.c) it is one pass per row; without, five
PyTorch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_TINY = 1e-12  # an all-zero row gets this scale instead of 0 (its int8 values are all 0)
_KERNEL_MAX_COLS = 4096  # the kernel's row buffer for bfloat16 input


def quantize_rows(x: torch.Tensor, kernels=None, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 scales [M, 1]) of a float [M, K]; with `unsigned` the same values
    as uint8 q + 128 (zero point 128), the input oneDNN's VNNI int8 GEMM takes."""
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16) and (
            x.dtype == torch.float32 or x.shape[1] <= _KERNEL_MAX_COLS):
        from batchrun.engine.kernels import kind

        x = x.contiguous()
        q = torch.empty(x.shape, dtype=torch.uint8 if unsigned else torch.int8)
        scale = torch.empty((x.shape[0], 1), dtype=torch.float32)
        fn = kernels.quantize_rows_u8 if unsigned else kernels.quantize_rows_int8
        fn(x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.shape[0], x.shape[1], kind(x.dtype),
           torch.get_num_threads())
        return q, scale
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
                        kernels=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 q + 128 and scales of x * mult as quantize_rows(unsigned=True) gives them,
    outlier_columns(x, outliers)): a smoothed Int8Linear's input in one pass. mult float32 [K],
    outliers int64 [n]."""
    rows, cols = x.shape
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16) and cols <= _KERNEL_MAX_COLS:
        from batchrun.engine.kernels import kind

        x = x.contiguous()
        q = torch.empty((rows, cols), dtype=torch.uint8)
        scale = torch.empty((rows, 1), dtype=torch.float32)
        x_out = torch.empty((rows, len(outliers) + len(outliers) % 2), dtype=torch.bfloat16)
        kernels.quantize_rows_split_u8(x.data_ptr(), mult.data_ptr(), outliers.data_ptr(), len(outliers),
                                       x_out.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols,
                                       kind(x.dtype), torch.get_num_threads())
        return q, scale, x_out
    q, scale = quantize_rows(x.float() * mult, kernels, unsigned=True)
    return q, scale, outlier_columns(x, outliers)


def rescale_rows(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernels=None,
                 x_out: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> None:
    """y[i] = y[i] * scale[i] (+ bias) (+ x_out[i] @ pairs_matrix(pairs): the outlier channels'
    bfloat16 GEMM, float32 sums; x_out from outlier_columns, pairs from outlier_pairs), float32
    [M, N] in place; with the kernels one pass over y."""
    if kernels is not None and y.is_contiguous() and y.dtype == torch.float32:
        if x_out is not None:
            x_out, pairs = x_out.contiguous(), pairs.contiguous()
        kernels.scale_rows(y.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(),
                           0 if x_out is None else x_out.data_ptr(),
                           0 if x_out is None else pairs.data_ptr(),
                           0 if x_out is None else pairs.shape[0], y.shape[0], y.shape[1],
                           torch.get_num_threads())
        return
    y.mul_(scale)
    if bias is not None:
        y.add_(bias)
    if x_out is not None:
        y.addmm_(x_out.float(), pairs_matrix(pairs))
