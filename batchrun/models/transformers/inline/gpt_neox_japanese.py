"""GPT-NeoX-Japanese's attention on the engine's paged cache: one fused projection laid out
per head as (query, key, value), RoPE on the first rotary_ndims of each head, and the last
layer's dense bias returned apart (its decoder layer adds it with the residual)."""

from __future__ import annotations

import torch

from batchrun.models.transformers.attention import attend_layer
from batchrun.models.transformers.inline.families import modelling_module


def gpt_neox_japanese_forward(self, hidden_states, attention_mask=None, position_ids=None,
                              layer_past=None, use_cache=False, output_attentions=False,
                              position_embeddings=None, **kwargs):
    t, d, r = hidden_states.shape[1], self.head_size, self.rotary_ndims
    qkv = self.query_key_value(hidden_states)[0].view(t, self.num_attention_heads, 3 * d)
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    cos, sin = position_embeddings  # [1, T, r]; rotated as [1, heads, T, r]
    q_rot, k_rot = modelling_module(self).apply_rotary_pos_emb(
        q[..., :r].transpose(0, 1)[None], k[..., :r].transpose(0, 1)[None], cos, sin)
    q = torch.cat((q_rot[0].transpose(0, 1), q[..., r:]), dim=-1)
    k = torch.cat((k_rot[0].transpose(0, 1), k[..., r:]), dim=-1)
    out = attend_layer(self.batchrun_layer, q, k, v, 1 / self.norm_factor)
    return self.dense(out.reshape(1, t, -1)), None, self.dense_bias
