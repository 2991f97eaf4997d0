"""Paged prefill attention for CUDA in Triton: variable-length chunks, each causal within itself
and over its sequence's cached prefix, read through the block table where it lies (a prefix
-cache hit is not gathered; the chunk's own K/V is read back from the cache, written just before).

One program per (sequence, tile of BLOCK_M query rows, query head). Sequence i's rows are
query_start[i]:query_start[i + 1], the last rows of its context_lens[i] positions. A row at
position p sees keys j <= p, within p - window < j when a window is set, and, with
visible_until (an image's rows, Gemma 3), also keys p < j < until[row]. Soft-capping, sinks and
an fp8 cache as in triton_attention_common.py. The key walk covers only the blocks some row of the
tile sees: from the first row's window start to the last row's position (or its farthest until).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_attention_common import (attend_tile, cache_args, dot_dtype,
                                                           finish, head_slopes, key_tile,
                                                           tile_slots)


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, qstart_ptr, ctx_ptr,
                          until_ptr, sinks_ptr, alibi_ptr, first_seq, stride_qt, stride_qh,
                          stride_ot, stride_oh, stride_table, qk_scale, v_scale, window, softcap,
                          HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                          D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                          HAS_UNTIL: tl.constexpr, FP8: tl.constexpr, PREC: tl.constexpr,
                          DOT: tl.constexpr, HAS_ALIBI: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(qstart_ptr + seq)  # int64: it scales row strides
    q_len = (tl.load(qstart_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M < q_len:
        ctx = tl.load(ctx_ptr + seq).to(tl.int32)  # positions in int32: [M, N] masks stay small
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        qpos = ctx - q_len + rows
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
        heads = head + tl.zeros([BLOCK_M], tl.int32)
        slopes = head_slopes(alibi_ptr, heads, row_ok, HAS_ALIBI)
        hi = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
        until = tl.zeros([BLOCK_M], tl.int32)
        if HAS_UNTIL:
            until = tl.load(until_ptr + q_start + rows, mask=row_ok, other=0).to(tl.int32)
            hi = tl.maximum(hi, tl.minimum(tl.max(until, axis=0), ctx))
        lo = ctx * 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx - q_len + tile * BLOCK_M - window + 1, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        t = tl.arange(0, BLOCK_N)
        for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            kpos = start + t
            seen = kpos < ctx
            slots = tile_slots(tables_ptr, seq * stride_table, kpos, seen, BLOCK)
            allowed = kpos[None, :] <= qpos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (qpos[:, None] - kpos[None, :] < window)
            if HAS_UNTIL:
                allowed = allowed | ((kpos[None, :] > qpos[:, None])
                                     & (kpos[None, :] < until[:, None]))
            allowed = allowed & seen[None, :] & row_ok[:, None]
            acc, m, s = attend_tile(q, acc, m, s, k_ptr, v_ptr, slots, seen, allowed, kpos,
                                    slopes, d, d_ok, kvh, qk_scale, softcap, HKV, D,
                                    HAS_SOFTCAP, HAS_ALIBI, FP8, PREC)
        out = finish(acc, m, s, sinks_ptr, heads, row_ok, v_scale, HAS_SINKS)
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: torch.Tensor, tables: torch.Tensor, query_start: torch.Tensor,
                            context_lens: torch.Tensor, seqs: range, max_rows: int,
                            block_size: int, scale: float, window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None,
                            visible_until: torch.Tensor | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, alibi: torch.Tensor | None = None) -> None:
    """Attention of sequences `seqs` (consecutive; at most max_rows rows each) of q [T, H, D]
    into their rows of out [T, H, D], over caches [slots, Hkv, D] that already hold the step's
    K/V. tables [S, W] int64, query_start [S + 1], context_lens [S] on the device. k_scale /
    v_scale: an fp8 cache's layer scales (1 when the caller folded them into scale and out)."""
    if not len(seqs) or not max_rows:
        return
    assert q.stride(2) == 1 and out.stride(2) == 1
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    alibi = None if alibi is None else alibi.detach().float().contiguous()
    h, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    kc, vc, fp8 = cache_args(k_cache, v_cache)
    prec, dot = dot_dtype(q)
    block_m, warps = query_tile(max_rows, dim)
    grid = (len(seqs), triton.cdiv(max_rows, block_m), h)
    dummy = context_lens
    _paged_prefill_kernel[grid](
        q, kc, vc, out, tables, query_start, context_lens,
        dummy if visible_until is None else visible_until, dummy if sinks is None else sinks,
        dummy if alibi is None else alibi,
        seqs.start, q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        scale * k_scale, v_scale, window or 0, softcap or 0.0, HKV=hkv, GROUP=h // hkv, D=dim,
        D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK=block_size, BLOCK_M=block_m,
        BLOCK_N=key_tile(block_size, 64 if dim <= 64 else 32 if dim <= 128 else 16), HAS_WINDOW=window is not None,
        HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None,
        HAS_UNTIL=visible_until is not None, FP8=fp8, PREC=prec, DOT=dot,
        HAS_ALIBI=alibi is not None, num_warps=warps)


def query_tile(max_rows: int, dim: int) -> tuple[int, int]:
    """(BLOCK_M, warps): long chunks take 128-row tiles (each key tile read once for more rows)
    where the head dim leaves registers for them, 64 rows, or 32 past head dim 128; short chunks
    16 rows (few programs past a chunk's end). Chosen from ptxas's register report for sm_90
    (no spills at head dims 64, 128 and 256), not timed."""
    if max_rows <= 16:
        return 16, 8
    if dim > 128:
        return 32, 8
    return (128, 8) if max_rows >= 128 and dim <= 64 else (64, 8)
