"""The Gated DeltaNet mixer (linear attention with the gated delta rule) of transformers'
Qwen3-Next, Qwen3.5 (dense and MoE) and OLMo-Hybrid over the engine's state slots, for a step's
packed sequences at once.

Each sequence's rows are gathered into one row of a [S, L] batch as mamba.py lays them out; the
mixed q/k/v go through the depthwise causal convolution continued from the slot's last inputs,
q and k are L2-normalised, and the delta rule runs from the slot's recurrent state (zero for a
fresh sequence): per position, S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q / sqrt(d_k).
A padding position gets g = 0 and beta = 0, which leaves the state as it is, so the state after
the padded tail is the state after each sequence's last row.

A step with a chunk longer than one row runs the chunked (WY) form: within a chunk of C
positions the delta updates are one unit-lower-triangular solve, and the state is carried
chunk to chunk, so the loop is over L / C chunks instead of L positions. A step of decodes only
runs the recurrence once.

One sequence's state: the convolution's last kernel - 1 inputs [conv_dim, kernel - 1] in the
model's dtype, and the recurrent state [value heads, d_k, d_v] in float32, as transformers'
cache keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState
from batchrun.models.transformers.mamba import causal_conv

# transformers' classes of the layers this module runs
MIXERS = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
          "OlmoHybridGatedDeltaNet")
CHUNK = 64  # positions per chunk of the WY form (transformers' and FLA's)


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    return (StateTensor((mixer.conv_dim, mixer.conv_kernel_size - 1), dtype),
            StateTensor((mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim), torch.float32))


def projections(mixer, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed q|k|v [T, conv_dim], gate [T, value_dim], b [T, Hv], a [T, Hv]) of the rows x
    [T, hidden], as each family projects them."""
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z interleaved per key head
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x[None]),
                                                              mixer.in_proj_ba(x[None]))
        qkv = torch.cat([t[0].flatten(1) for t in (q, k, v)], dim=-1)
        return qkv, z[0].flatten(1), b[0], a[0]
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5
        return (mixer.in_proj_qkv(x), mixer.in_proj_z(x), mixer.in_proj_b(x),
                mixer.in_proj_a(x))
    qkv = torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], dim=-1)  # OLMo-Hybrid
    return qkv, mixer.g_proj(x), mixer.b_proj(x), mixer.a_proj(x)


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> torch.Tensor:
    """The mixer's output [1, T, hidden] for the step's flat rows `hidden` [1, T, hidden],
    updating the slots of `tensors` (conv state, recurrent state) of the step's sequences."""
    from transformers.activations import ACT2FN

    conv_cache, recurrent_cache = tensors
    qkv, gate, b, a = projections(mixer, hidden[0])
    rows, valid = step.padded_rows()
    S, L = rows.shape
    mixed = causal_conv((qkv[rows] * valid[..., None]).transpose(1, 2), mixer.conv1d,
                        conv_cache, step)
    mixed = ACT2FN[mixer.activation](mixed).to(qkv.dtype).transpose(1, 2)  # [S, L, conv_dim]
    q, k, v = mixed.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q, k = (t.reshape(S, L, mixer.num_k_heads, mixer.head_k_dim) for t in (q, k))
    v = v.reshape(S, L, mixer.num_v_heads, mixer.head_v_dim)
    beta = b[rows].float().sigmoid() * (2.0 if getattr(mixer, "allow_neg_eigval", False) else 1.0)
    g = -mixer.A_log.float().exp() * F.softplus(a[rows].float() + mixer.dt_bias.float())
    beta, g = beta.masked_fill(~valid[..., None], 0), g.masked_fill(~valid[..., None], 0)
    start = recurrent_cache[step.slots].float().masked_fill(step.fresh[:, None, None, None], 0)
    q, k, v, beta, g = heads_first(mixer, q, k, v, beta, g)
    rule = recurrent if L == 1 else chunked
    out, final = rule(q, k, v, beta, g, start)
    recurrent_cache[step.slots] = final.to(recurrent_cache.dtype)
    out = out.transpose(1, 2)[valid].to(hidden.dtype)  # [T, Hv, dv]
    norm = mixer.norm if hasattr(mixer, "norm") else mixer.o_norm
    out = norm(out.reshape(-1, mixer.head_v_dim), gate.reshape(-1, mixer.head_v_dim))
    project = mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj
    return project(out.reshape(hidden.shape[1], -1))[None]


def heads_first(mixer, q, k, v, beta, g) -> tuple[torch.Tensor, ...]:
    """q, k [S, Hv, L, dk] (L2-normalised in float32, q scaled by 1/sqrt(dk), each key head
    repeated for its value heads), v [S, Hv, L, dv], beta and g [S, Hv, L], all float32."""
    repeat = mixer.num_v_heads // mixer.num_k_heads
    q, k = (t.float().repeat_interleave(repeat, dim=2) for t in (q, k))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * mixer.head_k_dim ** -0.5
    return (q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2),
            beta.transpose(1, 2), g.transpose(1, 2))


def recurrent(q, k, v, beta, g, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one position at a time: outputs [S, H, L, dv] and the final state
    [S, H, dk, dv]. The decay g is a head's [S, H, L] or each key channel's [S, H, L, dk]
    (Kimi's)."""
    outs = []
    for t in range(q.shape[2]):
        decay = g[:, :, t, None, None] if g.dim() == 3 else g[:, :, t, :, None]
        state = state * decay.exp()
        remembered = (state * k[:, :, t, :, None]).sum(-2)  # S^T k [S, H, dv]
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2), state


def chunked(q, k, v, beta, g, state, size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule in chunks of `size` positions (the WY form), the same outputs and final
    state as `recurrent`. Within a chunk, with G_i the decay from the chunk's start to position
    i, the corrections u_i = beta_i (v_i - S_{i-1}^T k_i) satisfy the unit-lower-triangular
    system u_i + beta_i sum_{j<i} (G_i/G_j) (k_i.k_j) u_j = beta_i (v_i - G_i S_0^T k_i)."""
    L = q.shape[2]
    pad = -L % size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    S, H, total, dk = k.shape
    q, k, v = (t.reshape(S, H, total // size, size, t.shape[-1]) for t in (q, k, v))
    beta, g = (t.reshape(S, H, total // size, size) for t in (beta, g))
    decay = g.cumsum(-1)  # log G_i within each chunk
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * pair  # (G_i/G_j) k_i.k_j, j <= i
    system = (beta[..., None] * kk).masked_fill(causal.logical_not().logical_or(
        torch.eye(size, dtype=torch.bool, device=q.device)), 0) + torch.eye(size, device=q.device)
    scores = (q @ k.transpose(-1, -2)) * pair  # (G_i/G_j) q_i.k_j, j <= i
    bv = beta[..., None] * v
    bk = beta[..., None] * k * decay.exp()[..., None]
    w_v = torch.linalg.solve_triangular(system, bv, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, bk, upper=False, unitriangular=True)
    q_start = q * decay.exp()[..., None]  # reads S_0 decayed to position i
    k_end = k * (decay[..., -1:] - decay).exp()[..., None]  # writes decayed to the chunk's end
    outs = []
    for c in range(total // size):
        u = w_v[:, :, c] - w_k[:, :, c] @ state  # the chunk's corrections
        outs.append(q_start[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * decay[:, :, c, -1].exp()[..., None, None] + \
            k_end[:, :, c].transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)[:, :, :L], state
