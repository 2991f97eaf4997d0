"""The Mamba-2 (state-space duality) mixer of transformers' Mamba2Mixer over the engine's state
slots, for a step's packed sequences at once.

The step's rows are gathered one sequence per row of a [S, L] batch as in mamba.py (whose
convolution over the slots' last inputs this shares). transformers' chunked scan takes initial
states, so it runs here as transformers has it, fed each sequence's SSM state from its slot:
the time steps are computed first (softplus(dt + dt_bias), clamped to the mixer's limit) and
set to zero at padding positions, where a zero step neither decays the state nor adds to it,
so the final state the scan returns is each sequence's after its last row.

Falcon-H1's mixer is this one with its input and per-channel (muP) multipliers and, where its
config says, the gate without the norm.

One sequence's state: the convolution's last conv_kernel - 1 inputs [conv_dim, conv_kernel - 1]
and the SSM state [heads, head_dim, state_size], in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState
from batchrun.models.transformers.mamba import convolve

MIXER = "Mamba2Mixer"


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    return (StateTensor((mixer.conv_dim, mixer.conv_kernel_size - 1), dtype),
            StateTensor((mixer.num_heads, mixer.head_dim, mixer.ssm_state_size), dtype))


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> torch.Tensor:
    """The mixer's output [1, T, hidden] for the step's flat rows `hidden` [1, T, hidden],
    updating the slots of `tensors` (conv state, SSM state) of the step's sequences."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    conv_cache, ssm_cache = tensors
    inner, groups, n = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
    projected = mixer.in_proj(hidden[0] * getattr(mixer, "ssm_in_multiplier", 1.0))
    if hasattr(mixer, "mup_vector"):  # Falcon-H1's per-channel multipliers
        projected = projected * mixer.mup_vector[0, 0]
    gate, xbc, dt = projected.split([inner, mixer.conv_dim, mixer.num_heads], -1)
    rows, valid = step.padded_rows()
    S, L = rows.shape
    u = convolve(mixer, (xbc[rows] * valid[..., None]).transpose(1, 2), conv_cache, step)
    x, B, C = u.transpose(1, 2).split([inner, groups * n, groups * n], dim=-1)
    low, high = mixer.time_step_limit
    dt = F.softplus(dt[rows] + mixer.dt_bias.to(dt.dtype))
    # The time-step limit binds every position, as transformers' forward and mamba_ssm's chunked
    # scan apply it: transformers' one-token cached update leaves it out, so a position's
    # output would depend on whether a step took it alone or in a chunk (Nemotron-H's limit,
    # time_step_min, binds; generate then differs from its own forward where it does)
    dt = dt.clamp(low, high)
    dt = dt.masked_fill(~valid[..., None], 0)
    start = ssm_cache[step.slots].float().masked_fill(step.fresh[:, None, None, None], 0)
    x, B, C = (x.reshape(S, L, mixer.num_heads, mixer.head_dim), B.reshape(S, L, groups, n),
               C.reshape(S, L, groups, n))
    A = -torch.exp(mixer.A_log.float())
    if L == 1:  # decodes only: the recurrent update (the chunked scan would pad to a chunk)
        y, final = recurrent_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], mixer.D, start)
        y = y[:, None]
    else:
        y, final = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=mixer.chunk_size, D=mixer.D,
                                     initial_states=start, return_final_states=True)
    ssm_cache[step.slots] = final.to(ssm_cache.dtype)
    y = y.reshape(S, L, inner)
    if getattr(mixer, "mamba_rms_norm", True):
        y = mixer.norm(y, gate[rows])
    else:  # Falcon-H1 without the gated norm: the gate alone
        y = y * F.silu(gate[rows].float())
    return mixer.out_proj(y[valid].to(hidden.dtype))[None]


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of every sequence: x [S, H, P], dt [S, H], B and C [S, G, N], state
    [S, H, P, N] (float32) -> (output [S, H, P], the next state)."""
    heads = x.shape[1]
    B, C = (t.float().repeat_interleave(heads // t.shape[1], dim=1) for t in (B, C))
    dt = dt.float()
    state = state * torch.exp(dt * A)[..., None, None] + \
        (dt[..., None] * x.float())[..., None] * B[:, :, None, :]
    y = (state @ C[..., None]).squeeze(-1) + D.float()[:, None] * x.float()
    return y, state
