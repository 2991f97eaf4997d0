"""RoFormer's self-attention as a causal decoder (RoFormerForCausalLM, is_decoder set) on the
engine's paged cache: separate query, key and value projections, its rotary embedding (sines and
cosines interleaved per pair of channels, on the values too where rotary_value says) read from
its sinusoidal table at the step's positions — its encoder would count them from the cache's
length, which a step of several sequences does not have."""

from __future__ import annotations

import math

from batchrun.models.transformers import attention
from batchrun.models.transformers.attention import attend_layer
from batchrun.models.transformers.inline.families import split_heads


def install_roformer_positions(hf) -> None:
    """Each replaced attention module reads the encoder's sinusoidal table."""
    table = hf.roformer.encoder.embed_positions
    for module in hf.modules():
        if getattr(module, "batchrun_replaced", False):
            module.batchrun_sinusoid = table


def roformer_forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None,
                     encoder_hidden_states=None, cache=None, output_attentions=False, **kwargs):
    heads = self.num_attention_heads
    q, k, v = (split_heads(proj(hidden_states), heads).transpose(0, 1)[None]
               for proj in (self.query, self.key, self.value))  # [1, H, T, D]
    positions = attention.step_positions(q.shape[2], q.device)
    sinusoid = self.batchrun_sinusoid(q.shape[:2], position_ids=positions)[None, None]
    rotated = self.apply_rotary_position_embeddings(sinusoid, q, k, v if self.rotary_value else None)
    q, k = rotated[0], rotated[1]
    v = rotated[2] if self.rotary_value else v
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    out = attend_layer(self.batchrun_layer, q, k, v, 1 / math.sqrt(self.attention_head_size))
    return out.reshape(1, hidden_states.shape[1], -1), None
