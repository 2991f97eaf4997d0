"""XGLM's and TrOCR's decoder attention (fairseq's multi-head attention: the queries scaled
as projected, keys and values from the same hidden states) on the engine's paged cache, and
TrOCR's positions: its decoder counts them from transformers' cache length, which a step of
several sequences does not have, so its positional embedding reads the step's positions."""

from __future__ import annotations

import torch

from batchrun.models.transformers.attention import attend_layer
from batchrun.models.transformers.inline.families import _heads


def fairseq_forward(self, hidden_states, key_value_states=None, cache=None,
                    attention_mask=None, output_attentions=False, **kwargs):
    q = _heads(self.q_proj(hidden_states) * self.scaling, self.num_heads)
    k, v = (_heads(proj(hidden_states), self.num_heads) for proj in (self.k_proj, self.v_proj))
    out = attend_layer(self.batchrun_layer, q, k, v, 1.0)  # the queries carry the scale
    return self.out_proj(out.reshape(1, hidden_states.shape[1], -1)), None


def install_trocr_positions(hf) -> None:
    """TrOCR's decoder takes the step's position_ids (it would count from its cache): they
    reach its positional embedding, learned or sinusoidal, through a hook on the decoder."""
    decoder = hf.model.decoder
    embed = decoder.embed_positions

    def keep_positions(module, args, kwargs):
        embed.batchrun_positions = kwargs.get("position_ids")

    decoder.register_forward_pre_hook(keep_positions, with_kwargs=True)
    original = type(embed).forward

    def forward(self, input_ids, cache_length=0, position_ids=None):
        positions = getattr(self, "batchrun_positions", None)
        if positions is None:  # transformers' own forward (the load check's reference)
            return original(self, input_ids, cache_length)
        if isinstance(self, torch.nn.Embedding):  # learned
            return torch.nn.Embedding.forward(self, positions + self.offset)
        # sinusoidal: fairseq's positions start past padding_idx; a pad token's is padding_idx
        ids = torch.where(input_ids == self.padding_idx, self.padding_idx,
                          positions + self.padding_idx + 1)
        if not ids.is_meta and int(ids.max()) >= self.weights.size(0):
            self.weights = self.get_embedding(int(ids.max()) + 1, self.embedding_dim,
                                              self.padding_idx)
        return self.weights.to(ids.device).index_select(0, ids.view(-1)).view(*ids.shape, -1)

    embed.forward = forward.__get__(embed)
    embed.batchrun_replaced = True
