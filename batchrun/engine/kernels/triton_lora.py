"""Multi-LoRA on CUDA in Triton: a step's rows on many adapters in two launches, not two GEMMs
per adapter segment (the segmented GEMMs of Punica and S-LoRA).

A step's rows come in segments, contiguous runs of rows on one adapter: (start, end, slot). The
adapters' weights are stacked by slot, A^T as [slots, in, R] and B^T as [slots, R, out]
(zero-padded to the largest rank). `segmented_gemm` computes out[rows] (+)= x[rows] @ w[slot]
for every segment at once: one program per (segment, BLOCK_M rows of it, BLOCK_N columns),
reading its slot's weight where it lies. The shrink (x @ A^T, into a [T, R] buffer) and the
expand (+= shrunk @ B^T, in place on the base projection's output) are two such launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_dot import dot, dot_mode


@triton.jit
def _segmented_gemm_kernel(x_ptr, w_ptr, out_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr,
                           N, K, stride_xm, stride_ws, stride_wk, stride_om,
                           ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_end_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    m = start + tl.arange(0, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < end
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    steps = tl.where(start < end, tl.cdiv(K, BLOCK_K), 0)  # past the segment's rows: nothing
    for step in range(0, steps):
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + slot * stride_ws + k[:, None] * stride_wk + n[None, :],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot(x.to(w.dtype), w, acc, DOT)
    out_at = out_ptr + m[:, None] * stride_om + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def segmented_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, segments: torch.Tensor,
                   max_rows: int, accumulate: bool) -> None:
    """out[s:e] = (or +=, with `accumulate`) x[s:e] @ w[slot] for each (s, e, slot) row of
    `segments` (int32 [G, 3]); x [T, K], w [slots, K, N], out [T, N] (unit column strides);
    max_rows: the longest segment (the grid's rows). Rows outside the segments are left alone."""
    if len(segments) == 0 or max_rows == 0:
        return
    if x.stride(1) != 1 or out.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("segmented_gemm needs unit column strides")
    n, k = w.shape[2], w.shape[1]
    block_m = 16 if max_rows <= 16 else 32
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = 32
    starts, ends, slots = (segments[:, i].contiguous() for i in range(3))
    grid = (len(segments), triton.cdiv(max_rows, block_m), triton.cdiv(n, block_n))
    _segmented_gemm_kernel[grid](x, w, out, starts, ends, slots, n, k, x.stride(0), w.stride(0),
                                 w.stride(1), out.stride(0), ACCUMULATE=accumulate,
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                 DOT=dot_mode(w.dtype))


def lora_update(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                segments: torch.Tensor, max_rows: int) -> None:
    """y[s:e] += x[s:e] @ a_t[slot] @ b_t[slot] per segment, in place: x [T, in], y [T, out],
    a_t [slots, in, R], b_t [slots, R, out] (scaling folded into b_t)."""
    shrunk = torch.zeros(x.shape[0], a_t.shape[2], dtype=a_t.dtype, device=x.device)
    segmented_gemm(x, a_t, shrunk, segments, max_rows, accumulate=False)
    segmented_gemm(shrunk, b_t, y, segments, max_rows, accumulate=True)
