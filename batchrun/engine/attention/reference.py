"""Attention computed plainly, sequence by sequence, from the generic layout alone (any backend's
metadata): the portable path for attention variants the fast backends do not implement, and
the yardstick tests hold the backends to."""

from __future__ import annotations

import torch

from batchrun.engine.attention.base import AttentionMetadata


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                        sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of the step's rows (written into the cache at
    meta.slot_mapping); returns [T, H, D], computed in float32 (float64 for float64 q).

    sliding_window: a row attends to the last `sliding_window` positions only, itself included
    (transformers' sliding-window layers). softcap: scores become softcap * tanh(score /
    softcap) before masking (Gemma 2). sinks [H]: a learned logit per head that joins each
    row's softmax denominator and attends to nothing (GPT-OSS).
    """
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    bs = meta.block_size
    out = torch.zeros_like(q)
    starts = meta.query_start.tolist()
    for i, ctx in enumerate(meta.context_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        if e == s or ctx == 0:
            continue
        key_pos = torch.arange(ctx, device=q.device)
        slots = meta.block_tables[i, key_pos // bs] * bs + key_pos % bs
        keys = k_cache[slots].to(dtype).repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache[slots].to(dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].to(dtype), keys) * scale  # [H, n, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = meta.positions[s:e, None]
        allowed = key_pos[None, :] <= q_pos
        if sliding_window is not None:
            allowed &= key_pos[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.to(dtype)[:, None, None].expand(-1, e - s, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)
    return out
