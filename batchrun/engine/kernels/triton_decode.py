"""Paged decode attention for CUDA in Triton: one program per (sequence, KV head).

Each program keeps the query rows of its KV group (padded to tl.dot's 16 rows), walks the
sequence's block table reading K and V where they lie (no gather), and runs an online softmax;
a sliding window starts the walk at the window's first position, soft-capping, sinks and an
fp8 cache as in triton_attention_common.py. Context lengths are read on the device, so the
launch has fixed shapes and can be captured in a CUDA graph. A sequence of length 0 (a padding
row of a captured batch) writes zeros. Long contexts with few programs take the split-K kernel
(triton_splitk.py) instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_attention_common import (MIN_DOT, attend_keys, cache_args,
                                                           decode_group, dot_dtype, finish,
                                                           key_tile)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, sinks_ptr, alibi_ptr, out_ptr,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_table, qk_scale,
                         v_scale, window, softcap, HKV: tl.constexpr, D: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
                         PREC: tl.constexpr, DOT: tl.constexpr, HAS_ALIBI: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    q, heads, g_ok, d, d_ok, slopes, lo = decode_group(
        q_ptr, alibi_ptr, seq, kvh, stride_qt, stride_qh, length, window, D, GROUP, GROUP_PAD,
        D_PAD, HAS_WINDOW, HAS_ALIBI, DOT)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    acc, m, s = attend_keys(q, acc, m, s, k_ptr, v_ptr, tables_ptr, seq * stride_table,
                            lo // BLOCK_N * BLOCK_N, length, lo, length, slopes, g_ok, d, d_ok,
                            kvh, qk_scale, softcap, HKV, D, BLOCK, BLOCK_N, HAS_SOFTCAP,
                            HAS_ALIBI, FP8, PREC)
    out = finish(acc, m, s, sinks_ptr, heads, g_ok, v_scale, HAS_SINKS)
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def decode_launch_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_size: int, window: int | None, softcap: float | None,
                       sinks: torch.Tensor | None, alibi: torch.Tensor | None = None
                       ) -> tuple[tuple, dict]:
    """The arguments the decode kernels (this one, triton_splitk.py's and triton_cascade.py's)
    share: ((K cache, V cache, sinks, ALiBi slopes), constexprs)."""
    assert q.stride(2) == 1
    h, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    kc, vc, fp8 = cache_args(k_cache, v_cache)
    prec, dot = dot_dtype(q)
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    alibi = None if alibi is None else alibi.detach().float().contiguous()
    group = h // hkv
    consts = dict(HKV=hkv, D=dim, GROUP=group,
                  GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK=block_size,
                  BLOCK_N=key_tile(block_size, 64 if dim <= 128 else 32), D_PAD=max(MIN_DOT, triton.next_power_of_2(dim)),
                  HAS_WINDOW=window is not None, HAS_SOFTCAP=bool(softcap),
                  HAS_SINKS=sinks is not None, FP8=fp8, PREC=prec, DOT=dot,
                  HAS_ALIBI=alibi is not None,
                  num_warps=8 if dim > 64 else 4)  # head dim 128 on 4 warps spilled (sm_90)
    return (kc, vc, sinks, alibi), consts


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                           scale: float, window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, alibi: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """q [B, H, D]; caches [slots, Hkv, D]; tables [B, max_blocks]; lens [B] -> [B, H, D].
    window / softcap / sinks [H] / alibi [H]: the layer's (registry.paged_attention); k_scale /
    v_scale: an
    fp8 cache's layer scales (1 when the caller folded them into scale and the output)."""
    (kc, vc, sinks, alibi), consts = decode_launch_args(q, k_cache, v_cache, block_size, window,
                                                        softcap, sinks, alibi)
    b = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _paged_decode_kernel[(b, consts["HKV"])](
        q, kc, vc, tables, lens, lens if sinks is None else sinks,
        lens if alibi is None else alibi, out, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), tables.stride(0), scale * k_scale, v_scale, window or 0,
        softcap or 0.0, **consts)
    return out
