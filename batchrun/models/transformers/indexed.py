"""Sparse (indexed) attention run dense: DeepSeek-V3.2's DSA and the families built on it
(GLM-MoE-DSA, HY-V4) pick, per query, the `index_topk` keys a small indexer scores highest and
attend to those alone. Where a sequence's whole context is at most `index_topk` tokens the
indexer keeps every key, so dense attention over the paged cache is exactly the model's — the
backend caps such a model's context at `index_topk` (config_of) and runs every indexed layer
dense. The indexers' scores are then never read: their forwards are replaced by one that
returns no indices (the attention function ignores them), and the mask their attention slices
before calling the indexer is a free all-zeros view (`dense_mask`) instead of none.
Longer contexts need the indexer's top-k selection on the cache: not yet (models check says).
"""

from __future__ import annotations

from types import MethodType
from typing import Callable

import torch

INDEXED_LAYER_TYPES = {"indexed_attention"}


def indexed(text_config) -> bool:
    """Whether the model's attention is indexed (its config names an indexer's top-k)."""
    return bool(getattr(text_config, "index_topk", None))


def dense_context(text_config) -> int | None:
    """The longest context whose indexed attention is dense (None: not an indexed model)."""
    return int(text_config.index_topk) if indexed(text_config) else None


def dense_mask(batch_size: int, q_length: int, kv_length: int, *args, device="cpu", **kwargs):
    """A mask of no effect that indexed attention can slice: zeros, broadcast (no memory)."""
    return torch.zeros((), device=device).expand(batch_size, 1, q_length, kv_length)


def install(hf, in_step: Callable[[], bool]) -> None:
    """Every indexer of `hf` returns no indices while a batchrun step runs (`in_step`; its own
    forward otherwise: transformers' reference)."""
    for module in hf.modules():
        if type(module).__name__.endswith("Indexer") and not hasattr(module, "batchrun_own"):
            own = module.forward

            def forward(self, hidden_states, *args, _own=own, **kwargs):
                if not in_step():
                    return _own(hidden_states, *args, **kwargs)
                return torch.empty((*hidden_states.shape[:2], 0), dtype=torch.long,
                                   device=hidden_states.device)

            module.batchrun_own = own
            module.forward = MethodType(forward, module)
