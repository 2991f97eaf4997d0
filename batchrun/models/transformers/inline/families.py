"""The replacement forwards, one per family (inline/__init__.py installs them): each takes the
arguments the family's decoder layer passes its attention module, ignores the mask and cache
transformers would use, and returns what the original returns. Row order is the step's flat
row of tokens ([1, T, hidden] in, as the backend feeds the decoder)."""

from __future__ import annotations

import math
import sys

import torch

from batchrun.models.transformers.attention import attend_layer


def modelling_module(module):
    """The modelling module that defines `module`'s class (its RoPE and ALiBi helpers)."""
    return sys.modules[type(module).__module__]


def _alibi_slopes(module, heads: int, device) -> torch.Tensor:
    """ALiBi's per-head slopes from the family's own build_alibi_tensor: the bias of the key at
    position 1 of a two-token sequence, per head."""
    ones = torch.ones(1, 2, dtype=torch.long, device=device)
    return modelling_module(module).build_alibi_tensor(ones, heads, torch.float32).view(heads, 2)[:, 1]


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, T, heads * D] -> [T, heads, D]."""
    return x[0].view(x.shape[1], heads, -1)


def bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None,
                  use_cache=False, output_attentions=False, **kwargs):
    t = hidden_states.shape[1]
    fused = self.query_key_value(hidden_states).view(t, self.num_heads, 3, self.head_dim)
    q, k, v = fused.unbind(2)
    out = attend_layer(self.batchrun_layer, q, k, v, self.inv_norm_factor,
                       alibi=_alibi_slopes(self, self.num_heads, q.device) * self.beta)
    out = out.reshape(1, t, -1)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # the dense layer in slices, as BLOOM
        slices = self.hidden_size / self.pretraining_tp
        dense = torch.zeros_like(out)
        for i in range(self.pretraining_tp):
            part = slice(int(i * slices), int((i + 1) * slices))
            dense = dense + torch.nn.functional.linear(out[:, :, part], self.dense.weight[:, part])
    else:
        dense = self.dense(out)
    return modelling_module(self).dropout_add(dense, residual, self.hidden_dropout, False), None


def falcon_forward(self, hidden_states, alibi, attention_mask, position_ids=None,
                   layer_past=None, use_cache=False, output_attentions=False,
                   position_embeddings=None, **kwargs):
    t = hidden_states.shape[1]
    fused = self.query_key_value(hidden_states)
    if self.new_decoder_architecture:  # groups of (queries..., key, value): K/V per group
        qkv = fused[0].view(t, self.num_kv_heads, -1, self.head_dim)
        q, k, v = qkv[:, :, :-2].flatten(1, 2), qkv[:, :, -2], qkv[:, :, -1]
    else:
        q, k, v = (x[0] for x in self._split_heads(fused))
    scale = self.inv_norm_factor
    slopes = None
    if alibi is None:
        cos, sin = position_embeddings
        qr, kr = modelling_module(self).apply_rotary_pos_emb(q.transpose(0, 1)[None],
                                                    k.transpose(0, 1)[None], cos, sin)
        q, k = qr[0].transpose(0, 1), kr[0].transpose(0, 1)
    else:  # Falcon scales the ALiBi bias with the scores
        slopes = _alibi_slopes(self, self.num_heads, q.device) * scale
    out = attend_layer(self.batchrun_layer, q, k, v, scale, alibi=slopes)
    return self.dense(out.reshape(1, t, -1)), None


def gpt_neo_forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                    output_attentions=False, **kwargs):
    q, k, v = (split_heads(proj(hidden_states), self.num_heads)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    window = self.config.window_size if self.attention_type == "local" else None
    out = attend_layer(self.batchrun_layer, q, k, v, 1.0, window=window)  # GPT-Neo: unscaled
    out = self.out_proj(out.reshape(1, hidden_states.shape[1], -1))
    return self.resid_dropout(out), None


def openai_gpt_forward(self, x, attention_mask=None, output_attentions=False):
    q, k, v = (split_heads(part, self.n_head) for part in self.c_attn(x).split(self.split_size, dim=2))
    scale = 1 / math.sqrt(v.shape[-1]) if self.scale else 1.0
    out = attend_layer(self.batchrun_layer, q, k, v, scale)
    return [self.resid_dropout(self.c_proj(out.reshape(1, x.shape[1], -1)))]


def mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (split_heads(part, self.n_heads) for part in qkv.chunk(3, dim=2))
    slopes = None
    if position_bias is not None:  # MPT's ALiBi (as MptModel builds it: its default bias max)
        two = modelling_module(self).build_mpt_alibi_tensor(self.n_heads, 2, device=q.device)
        slopes = -two.view(self.n_heads, 2)[:, 0].float()
    out = attend_layer(self.batchrun_layer, q, k, v, self.softmax_scale, alibi=slopes)
    return self.out_proj(out.reshape(1, hidden_states.shape[1], -1)), None
