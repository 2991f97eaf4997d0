"""Weight-only GEMM for CUDA in Triton over one-byte weights: y = x @ W^T, W dequantised inside
the kernel from int8 or float8 e4m3 bytes with float32 scales in groups along the input.

w[n, k] = q[n, k] * scale[n, k // GROUP]: one group a row (GROUP = K) is int8-weight's per
channel scale; FP8 checkpoints' block scales are groups of the block's width. Each tile of
weights is widened to float32, scaled and rounded to x's dtype before the dot (as the CPU layers
dequantise to the activations' dtype), accumulating in float32; W never exists dense in memory.
float8 weights are passed as their bytes (uint8) and reinterpreted in-kernel (decoded with
integer ops on GPUs before sm_89, whose Triton has no e4m3 type: triton_fp8_bits.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_dot import dot, dot_mode
from batchrun.engine.kernels.triton_fp8_bits import e4m3_native, e4m3_to_float32


@triton.jit
def _weight_gemm_kernel(x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
                        GROUP: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        q = tl.load(q_ptr + n[None, :] * K + k[:, None], mask=w_ok, other=0)  # [BLOCK_K, BLOCK_N]
        if FP8_BITS:  # a GPU without the e4m3 type
            qf = e4m3_to_float32(q)
        elif FP8:
            qf = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            qf = q.to(tl.float32)
        scale = tl.load(scale_ptr + n[None, :] * G + k[:, None] // GROUP, mask=w_ok, other=0.0)
        w = (qf * scale).to(x.dtype)
        acc = dot(x, w, acc, DOT)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def weight_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
                fp8_bits: bool | None = None) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) @ (q * scale)^T -> [M, N] in x's dtype. q int8 or
    float8_e4m3fn [N, K]; scale float32 [N, ceil(K / group)]. fp8_bits: float8 bytes decoded
    with integer ops (default: only where Triton lacks the e4m3 type, GPUs before sm_89)."""
    m, k = x.shape
    n = q.shape[0]
    groups = -(-k // group)
    if q.shape[1] != k or q.dtype not in (torch.int8, torch.float8_e4m3fn) or \
            tuple(scale.shape) != (n, groups):
        raise ValueError(f"weight-only GEMM: x [{m}, {k}] against {q.dtype} weights "
                         f"{tuple(q.shape)} with scales {tuple(scale.shape)} in groups of {group}")
    fp8 = q.dtype == torch.float8_e4m3fn
    fp8_bits = fp8 and (not e4m3_native(x.device) if fp8_bits is None else fp8_bits)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_gemm_kernel[grid](x, (q.view(torch.uint8) if fp8 else q).contiguous(),
                              scale.float().contiguous(), y, m, n, k, groups, x.stride(0),
                              y.stride(0), GROUP=group, FP8=fp8, FP8_BITS=fp8_bits, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot_mode(x.dtype))
    return y
