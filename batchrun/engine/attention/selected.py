"""Attention to selected keys only (sparse, indexed attention: DeepSeek-V3.2's DSA picks, per
query, the keys an indexer scores highest): the step's K/V rows are written into the paged
cache, then each row attends to the cache positions `keys[row]` of its own sequence (-1: no
key), gathered through the block tables. Computed in float32 at least, rows in slices so the
gathered keys stay bounded in memory.
"""

from __future__ import annotations

import torch

from batchrun.engine.attention.base import AttentionMetadata
from batchrun.engine.attention.kv_write import read_rows, store_rows

# Gathered K/V elements one slice of rows may hold (K and V each)
SLICE_ELEMENTS = 1 << 24


def row_sequences(meta: AttentionMetadata) -> torch.Tensor:
    """[T] the sequence each of the step's rows belongs to."""
    starts = meta.query_start
    counts = starts[1:] - starts[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), device=starts.device), counts)


def position_slots(meta: AttentionMetadata, seqs: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The cache slots of `positions` ([..., n] >= 0) of sequences `seqs` ([...])."""
    bs = meta.block_size
    tables = meta.block_tables[seqs]
    return tables.gather(-1, positions // bs) * bs + positions % bs


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of the step's rows (written into the cache at
    meta.slot_mapping); keys [T, K]: the positions each row attends to (-1: none; every row
    names at least one). Returns [T, H, D]. A quantized cache (fp8, int8) goes through its
    wrapper, as paged_attention's steps do."""
    from batchrun.engine.attention.registry import QUANTIZED

    if k_cache.dtype in QUANTIZED:
        return QUANTIZED[k_cache.dtype](_selected, q, k, v, k_cache, v_cache, meta, scale, keys)
    return _selected(q, k, v, k_cache, v_cache, meta, scale, keys)


def _selected(q, k, v, k_cache, v_cache, meta, scale, keys) -> torch.Tensor:
    store_rows(k_cache, meta.slot_mapping, k)
    store_rows(v_cache, meta.slot_mapping, v)
    rows, heads, dim = q.shape
    kv_heads, width = k_cache.shape[-2], keys.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    seqs = row_sequences(meta)
    valid = keys >= 0
    slots = position_slots(meta, seqs, keys.clamp(min=0))
    out = torch.empty_like(q)
    step = max(1, SLICE_ELEMENTS // max(1, width * kv_heads * dim))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        n = b - a
        flat = slots[a:b].reshape(-1)
        ks = read_rows(k_cache, flat, dtype).view(n, width, kv_heads, -1)
        vs = read_rows(v_cache, flat, dtype).view(n, width, kv_heads, -1)
        qs = q[a:b].to(dtype).view(n, kv_heads, heads // kv_heads, dim)  # query heads by KV head
        scores = torch.einsum("ngqd,nkgd->ngqk", qs, ks) * scale
        scores.masked_fill_(~valid[a:b, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("ngqk,nkgd->ngqd", weights, vs).reshape(n, heads, -1).to(q.dtype)
    return out
