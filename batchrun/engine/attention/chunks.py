"""Prefill chunks attended by torch SDPA, shared by every backend for the chunks it leaves.

Fresh chunks (no cached context) come sorted by length, so a run of them of one length is one
batched causal SDPA call over views of the step's rows (an embedding run's many short prompts
would otherwise cost a call each per layer). A chunk over a cached context is one SDPA call over
its gathered context with a causal mask offset by that context.

A layer's sliding window or attention chunk (reach.py) narrows those masks; logit soft-capping,
attention sinks and ALiBi, which SDPA cannot apply, take reference.attend on the same rows
instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchrun.engine.attention.base import StepLayout
from batchrun.engine.attention.kv_write import read_rows
from batchrun.engine.attention.reach import first_visible, reach
from batchrun.engine.attention.reference import attend


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk's first token in the step's flat row
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached prefix + chunk)
    slots: torch.Tensor | None  # [ctx_len] KV slots to read; None when the chunk is its whole context
    batched: bool = False  # in one of the same_length runs
    in_kernel: bool = False  # attended by the backend's own kernel (slots unused)


def same_length_runs(prefills: list[PrefillChunk]) -> list[tuple[int, int, int]]:
    """(first row, chunks, length) of each run of 2+ adjacent fresh chunks (no cached context)
    of one length; marks those chunks `batched`."""
    runs: list[list[PrefillChunk]] = []
    current: list[PrefillChunk] = []
    for chunk in prefills:
        if chunk.slots is not None or chunk.in_kernel:
            continue
        if current and (chunk.q_len != current[0].q_len
                        or chunk.q_start != current[-1].q_start + current[-1].q_len):
            runs.append(current)
            current = []
        current.append(chunk)
    runs.append(current)
    runs = [r for r in runs if len(r) > 1]
    for run in runs:
        for chunk in run:
            chunk.batched = True
    return [(r[0].q_start, len(r), r[0].q_len) for r in runs]


def plan_prefills(layout: StepLayout, in_kernel: list[bool] | None = None
                  ) -> tuple[list[PrefillChunk], list[tuple[int, int, int]]]:
    """The step's prefill chunks (the sequences after the decodes) and their same-length runs;
    in_kernel[j] marks chunk j as attended elsewhere."""
    prefills = []
    bs, table = layout.block_size, layout.block_tables
    row = layout.num_decode
    for j, i in enumerate(range(layout.num_decode, len(layout.counts))):
        c, n = layout.starts[i], layout.counts[i]
        if in_kernel is not None and in_kernel[j]:
            prefills.append(PrefillChunk(row, n, c + n, None, in_kernel=True))
        else:
            slots = None
            if c > 0:
                pos = torch.arange(c + n, device=table.device)
                slots = table[i, pos // bs] * bs + pos % bs
            prefills.append(PrefillChunk(q_start=row, q_len=n, ctx_len=c + n, slots=slots))
        row += n
    return prefills, same_length_runs(prefills)


def chunk_mask(q_len: int, ctx_len: int, window: int | None, device,
               chunk: int | None = None) -> torch.Tensor:
    """[q_len, ctx_len] bool: the last q_len of ctx_len positions attend causally, within
    `window` positions, or their own attention `chunk`, when set."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    lowest = first_visible(q_pos, window, chunk)
    return mask if lowest is None else mask & (k_pos >= lowest)


def fresh_mask(n: int, window: int | None, chunk: int | None, device) -> torch.Tensor | None:
    """The mask of a fresh chunk of n positions from 0 (None: plain causal)."""
    most = reach(window, chunk)
    return None if most is None or most >= n else chunk_mask(n, n, window, device, chunk)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, softcap: float | None,
                    sinks: torch.Tensor | None = None,
                    alibi: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, n, H, D], k/v [B, L, Hkv, D] (keys at positions 0..L-1), mask [n, L] bool (None:
    causal, n == L), alibi [H] ALiBi slopes or None; returns [B, n, H, D]."""
    if softcap or sinks is not None or alibi is not None:
        if mask is None:
            mask = chunk_mask(q.shape[1], k.shape[1], None, q.device)
        bias = None
        if alibi is not None:
            dt = torch.promote_types(q.dtype, torch.float32)
            pos = torch.arange(k.shape[1], device=q.device, dtype=dt)
            bias = (alibi.to(dt)[:, None] * pos[None, :]).expand(q.shape[0], -1, -1)
        return attend(q, k, v, mask.expand(q.shape[0], -1, -1), scale, softcap, sinks, bias)
    og = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return og.transpose(1, 2)


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefills: list[PrefillChunk], same_length: list[tuple[int, int, int]],
                      scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      chunk: int | None = None, alibi: torch.Tensor | None = None) -> None:
    """Attention of the chunks not `in_kernel` into their rows of `out` (window, softcap,
    sinks, chunk and alibi: the layer's sliding window, logit soft-cap, attention sinks,
    attention chunk and ALiBi slopes, None for none)."""
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    for s, count, n in same_length:
        rows = slice(s, s + count * n)
        mask = fresh_mask(n, window, chunk, q.device)
        og = dense_attention(q[rows].view(count, n, num_heads, head_dim),
                             k[rows].view(count, n, num_kv_heads, head_dim),
                             v[rows].view(count, n, num_kv_heads, head_dim), mask, scale, softcap,
                             sinks, alibi)
        out[rows] = og.reshape(count * n, num_heads, head_dim)
    for part in prefills:
        if part.batched or part.in_kernel:
            continue
        s, n = part.q_start, part.q_len
        if part.slots is None:
            kp, vp = k[s:s + n], v[s:s + n]
            mask = fresh_mask(n, window, chunk, q.device)
        else:
            kp = read_rows(k_cache, part.slots, q.dtype)
            vp = read_rows(v_cache, part.slots, q.dtype)
            mask = chunk_mask(n, part.ctx_len, window, q.device, chunk)
        out[s:s + n] = dense_attention(q[None, s:s + n], kp[None], vp[None], mask, scale,
                                       softcap, sinks, alibi)[0]
