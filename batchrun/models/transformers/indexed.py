"""Sparse (indexed) attention: DeepSeek-V3.2's DSA and the families built on it (GLM-MoE-DSA,
HY-V4) pick, per query, the `index_topk` keys a small indexer scores highest and attend to those
alone.

For the indexers this backend runs (SELECTING: DeepSeek-V3.2's, GLM-MoE-DSA's) the indexer's
own projections, norm and RoPE make each token's indexer key, which the engine's cache keeps:
in the layer's V cache, in the columns beside the value head (`spread`: the cache's head dim is
widened where the value heads leave too few, config_of), so the KV cache manager's blocks,
prefix cache, preemption and forks carry them like K/V. Each query's scores over its sequence's
cached indexer keys (sum over indexer heads of weight * ReLU(q . k) / sqrt(D), causal) pick its
top-k, and the layer attends to those keys only (engine/attention/selected.py). While every
context in a step is at most `index_topk` tokens the indexer keeps every key: the step runs
dense on the paged attention (its keys are still stored).

Other indexers (HY-V4's) run dense with the context capped at `index_topk` (config_of), where
the indexer keeps every key; their forwards return no indices. The mask transformers' indexed
attention slices before calling its indexer is a free all-zeros view (`dense_mask`).
"""

from __future__ import annotations

import sys
from types import MethodType
from typing import Any, Callable

import torch
import torch.nn.functional as F

from batchrun.engine.attention import layer_metadata
from batchrun.engine.attention.fp8_kv import FP8, kv_scale
from batchrun.engine.attention.int8_kv import INT8
from batchrun.engine.attention.kv_write import read_rows
from batchrun.engine.attention.selected import SLICE_ELEMENTS, position_slots, row_sequences

INDEXED_LAYER_TYPES = {"indexed_attention"}
# Indexer classes whose selection runs on the engine's cache -> the RoPE function (of their
# modelling module) their forward applies to the indexer's query and key
SELECTING = {"DeepseekV32Indexer": "apply_rotary_pos_emb",  # half-split
             "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave"}
SELECTING_TYPES = {"deepseek_v32", "glm_moe_dsa"}


def indexed(text_config) -> bool:
    """Whether the model's attention is indexed (its config names an indexer's top-k)."""
    return bool(getattr(text_config, "index_topk", None))


def selects(text_config) -> bool:
    """Whether the indexer's top-k selection runs on the cache (else: dense, context capped)."""
    return indexed(text_config) and text_config.model_type in SELECTING_TYPES


def dense_context(text_config) -> int | None:
    """The context an indexed model is capped at, where its attention runs dense (None: not
    capped)."""
    return int(text_config.index_topk) if indexed(text_config) and not selects(text_config) \
        else None


def key_dim(text_config) -> int:
    """The width of an indexer key the V cache holds per token (0: none)."""
    return int(text_config.index_head_dim) if selects(text_config) else 0


def cache_head_dim(text_config, kv_heads: int, dk: int, dv: int) -> int:
    """The KV cache's head dim: the wider of K and V, widened so that the columns beside the
    value heads hold an indexer key where the model's indexer selects on the cache."""
    return widened(kv_heads, dk, dv, key_dim(text_config))


def widened(kv_heads: int, dk: int, dv: int, index_dim: int) -> int:
    """The wider of dk and dv, or dv plus enough columns per head for `index_dim` beside V."""
    width = max(dk, dv)
    if (width - dv) * kv_heads < index_dim:
        width = dv + -(-index_dim // kv_heads)
    return width


def spread(v: torch.Tensor, keys: torch.Tensor, dv: int) -> torch.Tensor:
    """v [T, heads, W] (zero past dv) with the indexer keys [T, D] in its columns past dv, head
    after head."""
    rows, heads, width = v.shape
    spare, dim = width - dv, keys.shape[-1]
    used = -(-dim // spare)
    flat = F.pad(keys.to(v.dtype), (0, used * spare - dim))
    v = v.clone()
    v[:, :used, dv:] = flat.view(rows, used, spare)
    return v


def gathered(v_cache: torch.Tensor, slots: torch.Tensor, dv: int, dim: int) -> torch.Tensor:
    """The indexer keys [n, D] float32 that `spread` put in the V cache's rows `slots` [n]."""
    used = -(-dim // (v_cache.shape[-1] - dv))
    if v_cache.dtype == INT8:  # dequantized by the rows' scales
        cols = read_rows(v_cache, slots, torch.float32)[:, :used, dv:]
    else:  # only the key's columns
        cols = v_cache[:, :used, dv:][slots].float()
        if v_cache.dtype == FP8:  # stored divided by the layer's V scale
            cols = cols * kv_scale(v_cache)
    return cols.reshape(len(slots), -1)[:, :dim]


def dense_mask(batch_size: int, q_length: int, kv_length: int, *args, device="cpu", **kwargs):
    """A mask of no effect that indexed attention can slice: zeros, broadcast (no memory)."""
    return torch.zeros((), device=device).expand(batch_size, 1, q_length, kv_length)


def install(hf, current_step: Callable[[], Any]) -> None:
    """Every indexer of `hf`, while a batchrun step runs (`current_step()`, attention.py's Step;
    its own forward otherwise: transformers' reference), selects on the engine's cache
    (SELECTING) or returns no indices (dense)."""
    for module in hf.modules():
        name = type(module).__name__
        if name.endswith("Indexer") and not hasattr(module, "batchrun_own"):
            own = module.forward
            rope = getattr(sys.modules[type(module).__module__], SELECTING.get(name, ""), None)

            def forward(self, *args, _own=own, _rope=rope, **kwargs):
                current = current_step()
                if current is None:
                    return _own(*args, **kwargs)
                hidden_states = _argument(args, kwargs, 0, "hidden_states")
                if _rope is not None:  # (SELECTING's forwards take these three first)
                    return select(self, _rope, current, hidden_states,
                                  _argument(args, kwargs, 1, "q_resid"),
                                  _argument(args, kwargs, 2, "position_embeddings"))
                return torch.empty((*hidden_states.shape[:2], 0), dtype=torch.long,
                                   device=hidden_states.device)

            module.batchrun_own = own
            module.forward = MethodType(forward, module)


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if len(args) > position else kwargs[name]


@torch.no_grad()
def select(module, rope, current, hidden_states: torch.Tensor, q_resid: torch.Tensor,
           position_embeddings) -> torch.Tensor:
    """The indexer `module`'s top-k key positions [1, T, K] for the T rows of the step
    `current` (-1: none), as its own forward scores them; [1, T, 0] (attend densely) while
    every context of the step is within the top-k. The rows' indexer keys go to the step, for
    the layer's V cache."""
    rows = hidden_states.shape[1]
    cos, sin = position_embeddings
    q = module.wq_b(q_resid).view(1, rows, module.n_heads, module.head_dim)
    k = module.k_norm(module.wk(hidden_states)).unsqueeze(2)
    rot = module.qk_rope_head_dim
    q_rot, k_rot = rope(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rot:]], dim=-1)[0].float()  # [T, H, D]
    k = torch.cat([k_rot, k[..., rot:]], dim=-1)[0, :, 0]  # [T, D]
    none = torch.empty((1, rows, 0), dtype=torch.long, device=hidden_states.device)
    if current.kv_caches is None:  # a shape-only probe
        return none
    current.index_keys[module.layer_idx] = k
    # the load's probe (no kv_shape: caches without room for the keys) attends densely
    if current.kv_shape is None or current.max_context <= module.index_topk:
        return none
    weights = module.weights_proj(hidden_states.to(module.weights_proj.weight.dtype))
    weights = weights[0].float() * module.n_heads ** -0.5  # [T, H]
    index = current.peek_index(module.layer_idx)
    meta = layer_metadata(current.meta, index)
    keys = sequence_keys(current.kv_caches[index][1], meta, k, module.config.v_head_dim)
    seqs, positions = row_sequences(meta), meta.positions
    top = min(module.index_topk, keys.shape[1])
    out = torch.empty((rows, top), dtype=torch.long, device=q.device)
    span = torch.arange(keys.shape[1], device=q.device)
    step = max(1, SLICE_ELEMENTS // max(1, keys.shape[1] * (module.n_heads + module.head_dim)))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        scores = F.relu(torch.einsum("nhd,nld->nhl", q[a:b], keys[seqs[a:b]])
                        * module.softmax_scale)
        index_scores = torch.einsum("nh,nhl->nl", weights[a:b], scores)
        index_scores.masked_fill_(span[None, :] > positions[a:b, None], float("-inf"))
        best = index_scores.topk(top, dim=-1)
        out[a:b] = best.indices.masked_fill(best.values == float("-inf"), -1)
    return out[None]


def sequence_keys(v_cache: torch.Tensor, meta, step_keys: torch.Tensor, dv: int) -> torch.Tensor:
    """[S, L, D] float32: the indexer keys of each sequence's context (L: the longest), the
    cache's for the positions before the step and the step's own (`step_keys` [T, D]) after."""
    ctx = meta.context_lens
    longest = int(ctx.max())
    span = torch.arange(longest, device=ctx.device)
    positions = span[None, :].expand(len(ctx), -1).minimum(ctx[:, None] - 1)
    slots = position_slots(meta, torch.arange(len(ctx), device=ctx.device), positions)
    dim = step_keys.shape[-1]
    keys = gathered(v_cache, slots.reshape(-1), dv, dim).view(len(ctx), longest, dim)
    keys[row_sequences(meta), meta.positions] = step_keys.float()
    return keys
