"""XGLM's and TrOCR's decoder attention (fairseq's multi-head attention: the queries scaled
as projected, keys and values from the same hidden states) on the engine's paged cache, and
TrOCR's positions: its decoder counts them from transformers' cache length, which a step of
several sequences does not have, so its learned positional embedding reads the step's."""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

from batchrun.models.transformers.attention import attend_layer
from batchrun.models.transformers.inline.families import split_heads
from batchrun.models.transformers.support import UnsupportedModelError


def fairseq_forward(self, hidden_states, key_value_states=None, cache=None,
                    attention_mask=None, output_attentions=False, **kwargs):
    q = split_heads(self.q_proj(hidden_states) * self.scaling, self.num_heads)
    k, v = (split_heads(proj(hidden_states), self.num_heads) for proj in (self.k_proj, self.v_proj))
    out = attend_layer(self.batchrun_layer, q, k, v, 1.0)  # the queries carry the scale
    return self.out_proj(out.reshape(1, hidden_states.shape[1], -1)), None


def install_trocr_positions(hf) -> None:
    """TrOCR's decoder takes the step's position_ids (it would count from its cache): they
    reach its learned positional embedding through a hook on the decoder."""
    decoder = hf.model.decoder
    embed = decoder.embed_positions
    if not isinstance(embed, torch.nn.Embedding):
        raise UnsupportedModelError(
            "trocr with sinusoidal positions (use_learned_position_embeddings false): "
            "transformers' from_pretrained leaves its position table on the meta device, so "
            "transformers cannot run it either")

    def keep_positions(module, args, kwargs):
        embed.batchrun_positions = kwargs.get("position_ids")

    decoder.register_forward_pre_hook(keep_positions, with_kwargs=True)
    original = type(embed).forward

    def forward(self, input_ids, cache_length=0, position_ids=None):
        positions = getattr(self, "batchrun_positions", None)
        if positions is None:  # transformers' own forward (the load check's reference)
            return original(self, input_ids, cache_length)
        return torch.nn.Embedding.forward(self, positions + self.offset)

    replaced: Any = embed  # its forward and marker set on the instance (inline.suspended)
    replaced.forward = MethodType(forward, embed)
    replaced.batchrun_replaced = True
