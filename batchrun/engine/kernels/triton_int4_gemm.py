"""Weight-only int4 GEMM for CUDA in Triton: y = x @ W^T with W dequantised inside the kernel.

W is in the layout batchrun's int4 layers keep (models/quant/int4_linear.py, which GPTQ, AWQ and
compressed-tensors checkpoints are read into): q uint8 nibbles in 0..15, w[n, k] = q[n, k] *
scale[n, g] + minimum[n, g] with g = k // group, scale and minimum float32 [N, K / group]. The
nibbles are packed two a byte in one of two layouts:
- plain: byte [n, k // 2] holds input k = 2j in its low nibble, 2j + 1 in its high one;
- torch's CPU int4 kernel's (`kernel_layout`): per block of 64 output rows, a [K, 32] run of
  bytes, byte [k, j] holding row j in its low nibble and row j + 32 in its high one.
Each program computes a [BLOCK_M, BLOCK_N] tile of y, accumulating in float32; a tile of nibbles
is read as bytes, shifted, scaled and cast to x's dtype before the dot, so W never exists dense
in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_dot import dot, dot_mode

_KERNEL_BLOCK_N = 64  # rows per block of the CPU kernel's layout


@triton.jit
def _int4_gemm_kernel(x_ptr, packed_ptr, scale_ptr, min_ptr, y_ptr, M, N, K, stride_xm,
                      stride_ym, GROUP: tl.constexpr, KERNEL_LAYOUT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    groups = K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if KERNEL_LAYOUT:  # [N / 64, K, 32] bytes; rows j and j + 32 of a block share one
            byte_at = (n[None, :] // 64) * (K * 32) + k[:, None] * 32 + (n[None, :] % 32)
            shift = ((n[None, :] % 64) // 32) * 4
        else:  # [N, K / 2] bytes; inputs 2j and 2j + 1 share one
            byte_at = n[None, :] * (K // 2) + k[:, None] // 2
            shift = (k[:, None] % 2) * 4
        w_ok = k_ok[:, None] & n_ok[None, :]
        packed = tl.load(packed_ptr + byte_at, mask=w_ok, other=0).to(tl.int32)
        q = ((packed >> shift) & 15).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        g_at = n[None, :] * groups + k[:, None] // GROUP
        scale = tl.load(scale_ptr + g_at, mask=w_ok, other=0.0)
        minimum = tl.load(min_ptr + g_at, mask=w_ok, other=0.0)
        w = (q * scale + minimum).to(x.dtype)
        acc = dot(x, w, acc, DOT)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              group: int, kernel_layout: bool) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) @ dequant(W)^T -> [M, N] in x's dtype. packed
    uint8 [N, K / 2]; scale, minimum float32 [N, K / group]."""
    m, k = x.shape
    n = packed.shape[0]
    if k % group or packed.shape[1] * 2 != k or (kernel_layout and n % _KERNEL_BLOCK_N):
        raise ValueError(f"int4 GEMM: x [{m}, {k}] against nibbles {tuple(packed.shape)} in "
                         f"groups of {group}{' (CPU kernel layout)' if kernel_layout else ''}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, packed.contiguous(), scale.contiguous(), minimum.contiguous(), y,
                            m, n, k, x.stride(0), y.stride(0), GROUP=group,
                            KERNEL_LAYOUT=kernel_layout, BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=block_k, DOT=dot_mode(x.dtype))
    return y
