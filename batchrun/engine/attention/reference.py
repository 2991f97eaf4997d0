"""Attention from the generic layout alone (any backend's metadata): the portable path for the
attention variants the fast backends do not implement (sliding windows, logit soft-capping,
attention sinks, ALiBi, chunked local attention), and the yardstick tests hold the backends to. Decode rows (one query token)
are attended in one batched call, each prefill chunk in one call over its gathered context
(only the last window's or chunk's keys when a layer has one: reach.py).
"""

from __future__ import annotations

from typing import Any

import torch

from batchrun.engine.attention.base import AttentionMetadata
from batchrun.engine.attention.kv_write import read_rows, store_rows
from batchrun.engine.attention.reach import first_visible, reach


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                        sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None,
                        alibi: torch.Tensor | None = None,
                        chunk: int | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of the step's rows (written into the cache at
    meta.slot_mapping); returns [T, H, D], computed in float32 at least.

    sliding_window: a row at position p attends to positions p - sliding_window < j <= p only
    (transformers' sliding-window layers). chunk: a row at position p attends to positions
    p - p % chunk <= j <= p only (Llama 4's chunked layers). softcap: scores become softcap * tanh(score /
    softcap) before masking (Gemma 2). sinks [H]: a learned logit per head that joins each
    row's softmax denominator and attends to nothing (GPT-OSS). alibi [H]: each head's score
    of a key gains slope * the key's position (ALiBi: BLOOM, Falcon; softmax leaves the
    query's own position out of it). meta.visible_until: rows that
    also see later keys of their sequence (an image's tokens, both ways within the image; the
    step holds the whole image).
    """
    store_rows(k_cache, meta.slot_mapping, k)
    store_rows(v_cache, meta.slot_mapping, v)
    starts = meta.query_start.tolist()
    ctx = meta.context_lens.tolist()
    out = torch.empty_like(q)
    decode = [s for s in range(len(ctx)) if starts[s + 1] - starts[s] == 1]
    extras: dict[str, Any] = dict(window=sliding_window, softcap=softcap, sinks=sinks,
                                  alibi=alibi, chunk=chunk)
    until = meta.visible_until
    if decode:
        rows = torch.tensor([starts[s] for s in decode], device=q.device)
        out[rows] = _attend_sequences(q[rows].unsqueeze(1), [ctx[s] for s in decode], decode,
                                      k_cache, v_cache, meta, scale, **extras).squeeze(1)
    for s in range(len(ctx)):
        a, b = starts[s], starts[s + 1]
        if b - a > 1:
            out[a:b] = _attend_sequences(q[a:b].unsqueeze(0), [ctx[s]], [s], k_cache, v_cache,
                                         meta, scale, **extras,
                                         until=None if until is None else until[a:b][None])[0]
    return out


def _attend_sequences(q: torch.Tensor, ctx: list[int], seqs: list[int], k_cache, v_cache, meta,
                      scale: float, window, softcap, sinks, alibi=None,
                      until: torch.Tensor | None = None, chunk: int | None = None
                      ) -> torch.Tensor:
    """q [B, n, H, D]: the last n tokens of each of sequences `seqs` (context lengths ctx);
    until [B, n]: keys before it are visible too (meta.visible_until's rows)."""
    dev, bs, n = q.device, meta.block_size, q.shape[1]
    ctx_t = torch.tensor(ctx, device=dev)
    most = reach(window, chunk)
    span = max(ctx) if most is None else min(max(ctx), most + n - 1)
    first = (ctx_t - span).clamp(min=0)  # the earliest key position any query needs
    kpos = first[:, None] + torch.arange(span, device=dev)[None, :]  # [B, L]
    valid = kpos < ctx_t[:, None]
    kpos = kpos.masked_fill(~valid, 0)
    tables = meta.block_tables[torch.tensor(seqs, device=dev)]
    slots = tables.gather(1, kpos // bs) * bs + kpos % bs
    qpos = ctx_t[:, None] - n + torch.arange(n, device=dev)[None, :]  # [B, n]
    allowed = valid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])
    lowest = first_visible(qpos, window, chunk)
    if lowest is not None:
        allowed &= kpos[:, None, :] >= lowest[:, :, None]
    if until is not None:
        keys = kpos[:, None, :]
        later = (keys > qpos[:, :, None]) & (keys < until.to(dev)[:, :, None])
        allowed |= valid[:, None, :] & later
    dt = torch.promote_types(q.dtype, torch.float32)
    bias = None if alibi is None else alibi.to(dt)[None, :, None] * kpos[:, None, :].to(dt)
    return attend(q, read_rows(k_cache, slots, dt), read_rows(v_cache, slots, dt), allowed, scale,
                  softcap, sinks, bias)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           softcap: float | None = None, sinks: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention, in float32 at least: q [B, n, H, D], k/v [B, L, Hkv, Dv], allowed
    [B, n, L] bool, sinks [H] or None, bias [B, H, L] (added to the scores of every query) or
    None; returns [B, n, H, Dv] in q's dtype."""
    b, n, h, d = q.shape
    hkv = k.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dt).view(b, n, hkv, h // hkv, d)
    scores = torch.einsum("bnkgd,blkd->bkgnl", qg, k.to(dt)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.view(b, hkv, h // hkv, 1, -1)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dt).view(1, hkv, h // hkv, 1, 1).expand(b, -1, -1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgnl,blkd->bnkgd", probs, v.to(dt))
    return out.reshape(b, n, h, v.shape[-1]).to(q.dtype)
