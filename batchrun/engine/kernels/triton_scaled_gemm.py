"""Scaled GEMMs for CUDA in Triton: y = (a @ b^T) * a_scale[m] * b_scale[n] (+ bias[n]).

Two operand kinds, both one byte an element, scaled per row of a (a token: dynamic activation
scales) and per row of b (an output channel: the weights' scales):
- int8 x int8 (W8A8): int32 accumulation, exact; the float rescale happens once, in the epilogue;
- float8 e4m3 x float8 e4m3: float32 accumulation. Hopper and Ada (sm_89+) multiply float8 in
  the tensor cores; older GPUs, whose Triton has no e4m3 type, widen each tile's bytes to float32
  with integer ops in-kernel (triton_fp8_bits.py; every e4m3 value is exact in TF32, what
  their float32 dots multiply) before the dot. Triton 3.9's interpreter runs the float8 dot itself, exactly.

float8 operands are passed as their bytes (uint8 views) and reinterpreted in-kernel, so the same
call runs on a GPU and under the interpreter. `quantize_rows_int8` / `quantize_rows_fp8` make the
dynamic per-token activations with torch ops on the activations' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_fp8_bits import e4m3_native, e4m3_to_float32

FP8_MAX = 448.0  # the largest finite float8 e4m3fn
_TINY = 1e-12


@triton.jit
def _scaled_gemm_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, y_ptr, M, N, K,
                        stride_am, stride_bn, stride_ym, FP8: tl.constexpr,
                        WIDEN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    if FP8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_ptr + m[:, None] * stride_am + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptr + n[None, :] * stride_bn + k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        if FP8 and WIDEN:  # exact: an e4m3 value fits TF32's (and float32's) mantissa
            acc = tl.dot(e4m3_to_float32(a), e4m3_to_float32(b), acc, out_dtype=tl.float32)
        elif FP8:  # the bytes as float8 e4m3 (byte 0 is +0.0, what the masks fill)
            acc = tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True),
                         acc, out_dtype=tl.float32)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    a_scale = tl.load(a_scale_ptr + m, mask=m_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + n, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                widen: bool | None = None) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T, both int8 or both float8_e4m3fn, times a_scale [M] (or [M, 1])
    per row and b_scale [N] per column, plus bias [N] -> [M, N] in out_dtype. widen: float8
    tiles widened to float32 before the dot (default: only on GPUs without float8 dots)."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or a.dtype != b.dtype or a.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"scaled GEMM: a {tuple(a.shape)} {a.dtype} against b "
                         f"{tuple(b.shape)} {b.dtype} (int8 or float8_e4m3fn, the same)")
    fp8 = a.dtype == torch.float8_e4m3fn
    if fp8:  # their bytes: reinterpreted in-kernel
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return y
    block_m, block_n, warps = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    widen = (not e4m3_native(a.device)) if widen is None else widen
    _scaled_gemm_kernel[grid](
        a, b, a_scale.float().reshape(-1).contiguous(), b_scale.float().reshape(-1).contiguous(),
        y if bias is None else bias.float().contiguous(), y, m, n, k, a.stride(0), b.stride(0),
        y.stride(0), FP8=fp8, WIDEN=fp8 and widen, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_warps=warps)
    return y


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) for m rows: decode-sized steps in thin tiles (the weights'
    bytes dominate), prefill chunks in 128 x 128 tiles with 8 warps (not yet timed on a GPU;
    a 128 x 128 int32 or float32 accumulator is 64 registers a thread there)."""
    if m <= 64:
        return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 4
    return 128, 128, 8


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8 of x [M, K]: (round(x / s) int8, s float32 [M]), s = max|x| / 127."""
    x = x.float()
    scale = x.abs().amax(dim=1).clamp_(min=_TINY).div_(127.0)
    return torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic float8 e4m3 of x [M, K]: (x / s as float8, s float32 [M]), s = max|x| / 448."""
    x = x.float()
    scale = x.abs().amax(dim=1).clamp_(min=_TINY).div_(FP8_MAX)
    q = (x / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_channels_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel float8 e4m3 weights: (w / s as float8 [N, K], s float32 [N])."""
    return quantize_rows_fp8(weight)
