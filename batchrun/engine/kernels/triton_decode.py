"""Paged decode attention for CUDA in Triton: one program per (sequence, KV head).

Each program keeps the query rows of its KV group, walks the sequence's block table reading K
and V blocks where they lie (no gather), and runs an online softmax. Context lengths are read on
the device, so the launch has fixed shapes and can be captured in a CUDA graph. A sequence of
length 0 (a padding row of a captured batch) writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                         stride_table, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr,
                         D_PAD: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, BLOCK)
    g_ok = g < GROUP
    d_ok = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + (seq * H + heads)[:, None] * D + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    num_blocks = tl.cdiv(length, BLOCK)
    for i in range(0, num_blocks):
        block = tl.load(tables_ptr + seq * stride_table + i)
        pos = i * BLOCK + t
        t_ok = pos < length
        offs = ((block * BLOCK + t)[:, None] * HKV + kvh) * D + d[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(s > 0, s, 1.0)[:, None]
    tl.store(out_ptr + (seq * H + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q [B, H, D]; caches [slots, Hkv, D]; tables [B, max_blocks]; lens [B] -> [B, H, D]."""
    b, h, dim = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    out = torch.empty_like(q)
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, tables, lens, out, scale, tables.stride(0), H=h, HKV=hkv, D=dim,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK=block_size,
        D_PAD=triton.next_power_of_2(dim))
    return out
