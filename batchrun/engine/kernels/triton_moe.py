"""Grouped GEMM for the MoE experts on CUDA in Triton: every expert's rows in one launch.

The rows arrive sorted by expert, each expert's run ending at `ends[e]` (cumulative, so an expert
without rows has an empty run). `expert_tiles` cuts the runs into tiles of at most BLOCK_M rows of
one expert, on the device and without a host sync (vLLM aligns each run to the block size by
padding; here a tile carries its own start and end instead). The grid is the bound on the number
of tiles, cdiv(rows, BLOCK_M) + experts, so its size is known without reading `ends`; tiles past
the last real one are empty and do no work. A program multiplies its tile by a BLOCK_N slice of
its expert's weight [out, in], accumulating in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_dot import dot, dot_mode


def expert_tiles(ends: torch.Tensor, block_m: int, num_rows: int) -> tuple[torch.Tensor, ...]:
    """(tile expert, tile start row, tile end row), int32 [cdiv(num_rows, block_m) + experts];
    unused tiles have start == end."""
    ends = ends.to(torch.int64)
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    counts = ends - starts
    tile_ends = torch.cumsum((counts + block_m - 1) // block_m, 0)  # tiles through expert e
    bound = triton.cdiv(num_rows, block_m) + len(ends)
    tile = torch.arange(bound, device=ends.device)
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp_(max=len(ends) - 1)
    first_tile = tile_ends[expert] - (counts[expert] + block_m - 1) // block_m
    start = starts[expert] + (tile - first_tile) * block_m
    end = torch.minimum(start + block_m, ends[expert])
    real = tile < tile_ends[-1]
    start = torch.where(real, start, 0)
    end = torch.where(real, end, 0)
    return expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                         N, K, stride_xm, stride_we, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    m = start + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < end
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    steps = tl.where(start < end, tl.cdiv(K, BLOCK_K), 0)  # an empty tile reads nothing
    for step in range(0, steps):
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = dot(x, w, acc, DOT)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def grouped_gemm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [P, in] sorted by expert, weights [experts, out, in], ends [experts] (cumulative row
    counts): row i times the transposed weight of its expert, [P, out] in rows' dtype."""
    p, k = rows.shape
    experts, n, _ = weights.shape
    rows = rows.contiguous()
    weights = weights.to(rows.dtype)
    if weights.stride(2) != 1:
        weights = weights.contiguous()
    y = torch.empty(p, n, dtype=rows.dtype, device=rows.device)
    if p == 0:
        return y
    block_m = 16 if p <= 16 * experts else 64  # decode: a few rows per expert
    block_n, block_k = 64, 32
    tile_expert, tile_start, tile_end = expert_tiles(ends, block_m, p)
    grid = (len(tile_expert), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](rows, weights, y, tile_expert, tile_start, tile_end, n, k,
                               rows.stride(0), weights.stride(0), weights.stride(1), y.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               DOT=dot_mode(rows.dtype))
    return y
