"""Zamba's Mamba mixer (transformers' ZambaMambaMixer: Mamba's selective scan split into
independent heads, each with its own x_proj and dt_proj weights) over the engine's state slots,
for a step's packed sequences at once, laid out and convolved as mamba.py does.

The in-projection interleaves each channel's input and gate; the convolution runs over all
channels, then each head projects its channels to its time step, B and C, and the scan runs
over positions for every sequence and head together (a padding position leaves the state as
it is).

One sequence's state: the convolution's last conv_kernel - 1 inputs [intermediate, kernel - 1]
and the SSM state [heads, head_dim, state_size], in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState
from batchrun.models.transformers.mamba import convolve

MIXER = "ZambaMambaMixer"


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    return (StateTensor((mixer.intermediate_size, mixer.conv_kernel_size - 1), dtype),
            StateTensor((mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.ssm_state_size), dtype))


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> torch.Tensor:
    """The mixer's output [1, T, hidden] for the step's flat rows `hidden` [1, T, hidden],
    updating the slots of `tensors` (conv state, SSM state) of the step's sequences."""
    conv_cache, ssm_cache = tensors
    projected = mixer.in_proj(hidden[0])
    x, gate = projected[:, 0::2], projected[:, 1::2]  # [T, I] each, interleaved per channel
    rows, valid = step.padded_rows()
    S, L = rows.shape
    heads, P, N, R = (mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.ssm_state_size,
                      mixer.time_step_rank)
    u = convolve(mixer, (x[rows] * valid[..., None]).transpose(1, 2), conv_cache, step)
    u = u.transpose(1, 2).reshape(S, L, heads, P)
    params = torch.einsum("hrp,slhp->slhr", mixer.x_proj_weight, u)
    dt, B, C = params.split([R, N, N], dim=-1)
    dt = torch.einsum("hpr,slhr->slhp", mixer.dt_proj_weight, dt)
    dt = F.softplus(dt.float() + mixer.dt_proj_bias.float())  # [S, L, H, P]
    A = -torch.exp(mixer.A_log.float())  # [H, P, N]
    state = ssm_cache[step.slots].float().masked_fill(step.fresh[:, None, None, None], 0)
    outs = []
    for t in range(L):  # positions, every sequence and head at once
        dt_t = dt[:, t, ..., None]  # [S, H, P, 1]
        nxt = torch.exp(A * dt_t) * state + \
            dt_t * u[:, t, ..., None].float() * B[:, t, :, None, :].float()
        state = torch.where(valid[:, t, None, None, None], nxt, state)
        outs.append((state @ C[:, t, :, :, None].float()).squeeze(-1))
    ssm_cache[step.slots] = state.to(ssm_cache.dtype)
    y = torch.stack(outs, dim=1) + u.float() * mixer.D.float()  # [S, L, H, P]
    y = y.reshape(S, L, heads * P) * F.silu(gate[rows].float())
    return mixer.out_proj(y[valid].to(hidden.dtype))[None]
