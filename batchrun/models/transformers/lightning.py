"""MiniMax's lightning attention (transformers' MiniMaxLightningAttention: linear attention whose
key-value state decays by a fixed rate per head) over the engine's state slots, for a step's
packed sequences at once, laid out as mamba.py lays them.

Per position: KV <- exp(-slope) KV + k^T v; o = q KV (no normalisation of q or k); then an RMS
norm, a sigmoid output gate and the output projection. A step runs it in chunks of CHUNK
positions: within a chunk the decays between positions form a causal [C, C] matrix and the
state is carried chunk to chunk. A padding position gets a zero log-decay (and zero k, v), so it
leaves the state as it is.

One sequence's state: KV [heads, head_dim, head_dim] in the model's dtype, as transformers'
cache keeps it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState

MIXER = "MiniMaxLightningAttention"
CHUNK = 64


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    d = mixer.head_dim
    return (StateTensor((mixer.num_attention_heads, d, d), dtype),)


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> tuple[torch.Tensor, None]:
    """The layer's (output [1, T, hidden], None) for the step's flat rows `hidden` [1, T,
    hidden], updating the step's sequences' slots of its key-value state."""
    (kv_cache,) = tensors
    x = hidden[0]
    heads, d = mixer.num_attention_heads, mixer.head_dim
    qkv = mixer.act_fn(mixer.qkv_proj(x)).reshape(-1, heads, 3 * d)
    rows, valid = step.padded_rows()
    qkv = (qkv[rows] * valid[..., None, None]).float().transpose(1, 2)  # [S, H, L, 3d]
    q, k, v = qkv.split(d, dim=-1)
    g = (-mixer.slope_rate.float().reshape(1, heads, 1)) * valid[:, None, :]  # [S, H, L]
    start = kv_cache[step.slots].float().masked_fill(step.fresh[:, None, None, None], 0)
    out, final = decayed(q, k, v, g, start)
    kv_cache[step.slots] = final.to(kv_cache.dtype)
    out = out.transpose(1, 2)[valid].reshape(x.shape[0], heads * d).to(x.dtype)
    out = F.sigmoid(mixer.output_gate(x)) * mixer.norm(out)
    return mixer.out_proj(out)[None], None


def decayed(q, k, v, g, state, size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear attention with a log-decay g [S, H, L] per position from `state` [S, H, dk, dv]:
    outputs [S, H, L, dv] and the final state, in chunks of `size` positions."""
    L = q.shape[2]
    pad = -L % size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, pad))
    S, H, total, _ = k.shape
    q, k, v = (t.reshape(S, H, total // size, size, t.shape[-1]) for t in (q, k, v))
    decay = g.reshape(S, H, total // size, size).cumsum(-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    scores = (q @ k.transpose(-1, -2)) * pair
    q_start = q * decay.exp()[..., None]
    k_end = k * (decay[..., -1:] - decay).exp()[..., None]
    outs = []
    for c in range(total // size):
        outs.append(q_start[:, :, c] @ state + scores[:, :, c] @ v[:, :, c])
        state = state * decay[:, :, c, -1].exp()[..., None, None] + \
            k_end[:, :, c].transpose(-1, -2) @ v[:, :, c]
    return torch.cat(outs, dim=2)[:, :, :L], state
