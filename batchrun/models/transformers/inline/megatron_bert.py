"""Megatron-BERT's self-attention as a causal decoder (MegatronBertForCausalLM, is_decoder
set) on the engine's paged cache: separate query, key and value projections, scores scaled by
1/sqrt(head dim); the output projection stays in its MegatronBertSelfOutput."""

from __future__ import annotations

import math

from batchrun.models.transformers.attention import attend_layer
from batchrun.models.transformers.inline.families import split_heads


def megatron_bert_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                          cache=None, output_attentions=False, **kwargs):
    heads = self.num_attention_heads
    q, k, v = (split_heads(proj(hidden_states), heads) for proj in (self.query, self.key, self.value))
    out = attend_layer(self.batchrun_layer, q, k, v, 1 / math.sqrt(self.attention_head_size))
    return out.reshape(1, hidden_states.shape[1], -1), None
