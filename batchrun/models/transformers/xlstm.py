"""xLSTM's mLSTM layer (transformers' xLSTMLayer: a matrix memory with exponential input and
sigmoid forget gates, stabilised by a running maximum) over the engine's state slots, for a
step's packed sequences at once, laid out one sequence per row of a padded [S, L] batch as
mamba.py lays them.

Per position and head, with f' = logsigmoid(f): m' = max(f' + m, i); C <- exp(f' + m - m') C +
exp(i - m') k v^T; n <- the same of n and k; h = C^T q' / (max(|q'.n|, exp(-m')) + eps) with
q' = q / sqrt(d_qk): transformers' recurrent step, run for every position (its chunkwise
kernel gives the same states up to rounding). A fresh sequence starts from C = 0, n = 0, m = 0,
as transformers' does; a padding position leaves the state as it is.

One sequence's state: C [heads, d_qk, d_v], n [heads, d_qk] and m [heads, 1], in float32
(transformers' inference_state_dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState

MIXER = "xLSTMLayer"


def state_tensors(layer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    heads = layer.config.num_heads
    dqk, dv = layer.qk_dim // heads, layer.v_dim // heads
    return (StateTensor((heads, dqk, dv), torch.float32),
            StateTensor((heads, dqk), torch.float32), StateTensor((heads, 1), torch.float32))


def soft_cap(x: torch.Tensor, cap) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


def projections(layer, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, k, v, output gate, input gate, forget gate) of the rows x [T, hidden]."""
    cap, heads = layer.config.gate_soft_cap, layer.config.num_heads
    if layer.config.weight_mode == "single":
        return (layer.q(x), layer.k(x), layer.v(x), layer.ogate_preact(x),
                soft_cap(layer.igate_preact(x), cap), soft_cap(layer.fgate_preact(x), cap))
    q, k, v, o = torch.tensor_split(layer.qkv_opreact(x), (
        layer.qk_dim, 2 * layer.qk_dim, 2 * layer.qk_dim + layer.v_dim), dim=-1)
    i, f = torch.tensor_split(soft_cap(layer.ifgate_preact(x), cap), (heads,), dim=-1)
    return q, k, v, o, i, f


def forward(layer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> tuple[torch.Tensor, None]:
    """The layer's (output [1, T, hidden], None) for the step's flat rows `hidden`, updating
    the step's sequences' slots of its state."""
    x = hidden[0]
    q, k, v, o, i, f = projections(layer, x)
    rows, valid = step.padded_rows()
    S, L = rows.shape
    heads = layer.config.num_heads
    q, k, v = (t[rows].reshape(S, L, heads, -1).transpose(1, 2) for t in (q, k, v))
    i, f = (t[rows].float().transpose(1, 2)[..., None] for t in (i, f))  # [S, H, L, 1]
    fresh = step.fresh[:, None, None]
    C, n, m = (t[step.slots].masked_fill(fresh[..., None] if t.dim() == 4 else fresh, 0)
               for t in tensors)
    outs = []
    scale = q.shape[-1] ** -0.5
    for t in range(L):
        ok = valid[:, t, None, None]
        f_log = F.logsigmoid(f[:, :, t])
        m_new = torch.maximum(f_log + m, i[:, :, t])
        f_act, i_act = torch.exp(f_log + m - m_new), torch.exp(i[:, :, t] - m_new)
        q_t, k_t, v_t = q[:, :, t] * scale, k[:, :, t].float(), v[:, :, t].float()
        C_new = f_act[..., None] * C + i_act[..., None] * (k_t[..., :, None] * v_t[..., None, :])
        n_new = f_act * n + i_act * k_t
        num = (q_t[:, :, None, :] @ C_new.to(q_t.dtype)).squeeze(2).float()
        dot = (q_t[:, :, None, :] @ n_new[..., None].to(q_t.dtype)).squeeze(2).float()
        outs.append((num / (torch.maximum(dot.abs(), torch.exp(-m_new)) + layer.config.eps)
                     ).to(x.dtype))
        C, n, m = (torch.where(ok[..., None], C_new, C), torch.where(ok, n_new, n),
                   torch.where(ok, m_new, m))
    for cache, value in zip(tensors, (C, n, m)):
        cache[step.slots] = value
    h = torch.stack(outs, dim=2).transpose(1, 2)[valid]  # [T, H, dv]
    h = layer.multihead_norm(h[None]).reshape(x.shape[0], -1)
    return layer.out_proj(layer.ogate_act_fn(o) * h)[None], None
