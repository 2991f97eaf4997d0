"""Kimi Delta Attention (transformers' KimiLinearDeltaAttention) over the engine's state slots:
gated_delta.py's delta rule with a decay per key channel instead of per head, for a step's
packed sequences at once, laid out as mamba.py lays them.

A per-channel decay does not factor through the chunked (WY) form's pairwise head decays
without dividing by decays that underflow, so every step runs the recurrence, one position at
a time for all sequences together (as mamba.py's scan). A padding position gets g = 0 and
beta = 0 and leaves the state as it is.

One sequence's state: the q/k/v convolution's last kernel - 1 inputs [3 x heads x d, kernel - 1]
in the model's dtype and the recurrent state [heads, d, d] in float32, as transformers' cache
keeps them.
"""

from __future__ import annotations

import torch

from batchrun.engine.state_slots import StateTensor, StepState
from batchrun.models.transformers.gated_delta import recurrent
from batchrun.models.transformers.mamba import causal_conv

MIXER = "KimiLinearDeltaAttention"


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    return (StateTensor((mixer.conv_dim, mixer.conv_kernel_size - 1), dtype),
            StateTensor((mixer.num_heads, mixer.head_dim, mixer.head_dim), torch.float32))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's: x / sqrt(|x|^2 + eps), in float32."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> torch.Tensor:
    """The layer's output [1, T, hidden] for the step's flat rows `hidden` [1, T, hidden],
    updating the slots of `tensors` (conv state, recurrent state) of the step's sequences."""
    from transformers.activations import ACT2FN

    conv_cache, recurrent_cache = tensors
    x = hidden[0]
    heads, d = mixer.num_heads, mixer.head_dim
    qkv = torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], dim=-1)
    rows, valid = step.padded_rows()
    S, L = rows.shape
    mixed = causal_conv((qkv[rows] * valid[..., None]).transpose(1, 2), mixer.conv1d,
                        conv_cache, step)
    mixed = ACT2FN[mixer.activation](mixed).to(qkv.dtype).transpose(1, 2)  # [S, L, conv_dim]
    q, k, v = (t.reshape(S, L, heads, d).float().transpose(1, 2)
               for t in mixed.split([mixer.qkv_dim] * 3, dim=-1))  # [S, H, L, d]
    q, k = l2norm(q) * d ** -0.5, l2norm(k)
    g = mixer.forget_gate(x[None])[0][rows].float()  # [S, L, H, d]
    beta = mixer.b_proj(x).float().sigmoid()[rows]  # [S, L, H]
    g = g.masked_fill(~valid[..., None, None], 0).transpose(1, 2)
    beta = beta.masked_fill(~valid[..., None], 0).transpose(1, 2)
    start = recurrent_cache[step.slots].float().masked_fill(step.fresh[:, None, None, None], 0)
    out, final = recurrent(q, k, v, beta, g, start)
    recurrent_cache[step.slots] = final.to(recurrent_cache.dtype)
    out = out.transpose(1, 2)[valid].to(hidden.dtype)  # [T, H, d]
    gate = mixer.g_b_proj(mixer.g_a_proj(x)).reshape(-1, heads, d)
    out = mixer.o_norm(out, gate).reshape(x.shape[0], -1)
    return mixer.o_proj(out)[None]
