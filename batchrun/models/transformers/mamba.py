"""The Mamba (selective SSM) mixer of transformers' MambaMixer over the engine's state slots,
for a step's packed sequences at once (Jamba's and Falcon-Mamba's mixers too: the same, with
RMS norms on dt, B and C).

transformers' own mixer runs one batch of equal-length sequences and its full-sequence scan
always starts from a zero state, so a prefill chunk after the first cannot continue a sequence;
this forward takes the flat step row instead: each sequence's rows are gathered into one row of
a [S, L] batch (L = the step's longest chunk), its convolution state prepended and its SSM state
carried in from its slot (zero for a sequence's first chunk), the scan runs over L positions for
all sequences together (a padding position leaves the state as it is), and the final states go
back to the slots. A decode is the case L = 1. The maths is transformers' (its weights, its
discretisation: exp(dt A), dt B x), not a copy of its code.

A step's state checkpoints (engine/state_checkpoints.py: the state after given rows of a
sequence's chunk, for prefix caching) are written as the step runs: the convolution's inputs
before that row, and the scan's state as it passes that row.

One sequence's state: the last conv_kernel - 1 inputs of the convolution [intermediate,
conv_kernel - 1] and the SSM state [intermediate, state_size], both in the model's dtype as
transformers keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState

MIXER = "MambaMixer"  # transformers' class of the layers this module runs
WRITES_CHECKPOINTS = True  # it writes StepState.checkpoints (stateful.spec_of reads this)


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    inner = mixer.intermediate_size
    return (StateTensor((inner, mixer.conv_kernel_size - 1), dtype),
            StateTensor((inner, mixer.ssm_state_size), dtype))


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> torch.Tensor:
    """The mixer's output [1, T, hidden] for the step's flat rows `hidden` [1, T, hidden],
    updating the slots of `tensors` (conv state, SSM state) of the step's sequences."""
    conv_cache, ssm_cache = tensors
    x, gate = mixer.in_proj(hidden[0]).chunk(2, dim=-1)  # [T, I] each
    rows, valid = step.padded_rows()
    u = convolve(mixer, (x[rows] * valid[..., None]).transpose(1, 2), conv_cache, step)
    u = u.transpose(1, 2)  # [S, L, I]
    dt, B, C = torch.split(mixer.x_proj(u), [mixer.time_step_rank, mixer.ssm_state_size,
                                             mixer.ssm_state_size], dim=-1)
    if hasattr(mixer, "dt_layernorm"):  # Jamba's and Falcon-Mamba's norms on dt, B and C
        dt, B, C = mixer.dt_layernorm(dt), mixer.b_layernorm(B), mixer.c_layernorm(C)
    dt = F.softplus(mixer.dt_proj(dt).float())  # [S, L, I]
    y = scan(mixer, u, dt, B, C, valid, ssm_cache, step)
    y = (y + u * mixer.D) * F.silu(gate[rows])
    return mixer.out_proj(y[valid].to(hidden.dtype))[None]


def convolve(mixer, x: torch.Tensor, conv_cache: torch.Tensor, step: StepState) -> torch.Tensor:
    """The activated causal convolution [S, I, L] of the padded chunks x [S, I, L] (causal_conv)."""
    return mixer.act(causal_conv(x, mixer.conv1d, conv_cache, step)).to(x.dtype)


def causal_conv(x: torch.Tensor, conv, conv_cache: torch.Tensor, step: StepState) -> torch.Tensor:
    """The depthwise causal convolution `conv` [S, I, L] of the padded chunks x [S, I, L], each
    after its slot's last inputs (zeros for a fresh sequence); the slots get each chunk's last
    kernel - 1 inputs, the step's checkpoint slots those before their rows."""
    keep = conv_cache.shape[-1]
    before = conv_cache[step.slots].to(x.dtype).masked_fill(step.fresh[:, None, None], 0)
    joined = torch.cat([before, x], dim=-1)  # [S, I, keep + L]; sequence i's inputs end at keep + n_i
    last = step.counts[:, None, None] + torch.arange(keep, device=x.device)
    conv_cache[step.slots] = joined.gather(-1, last.expand(-1, x.shape[1], -1)).to(conv_cache.dtype)
    if len(step.checkpoints):
        seq, rows, slots = step.checkpoints.tensors(x.device)
        before_row = rows[:, None] + torch.arange(keep, device=x.device)  # [K, keep]
        # (indexing [S, L, I] gathers only the kept inputs, not each sequence's whole chunk)
        kept = joined.transpose(1, 2)[seq[:, None], before_row]  # [K, keep, I]
        conv_cache[slots] = kept.transpose(1, 2).to(conv_cache.dtype)
    joined = joined.to(conv.weight.dtype)
    if x.shape[-1] > 8:
        return F.conv1d(joined, conv.weight, conv.bias, groups=x.shape[1])
    # decodes (L = 1): the taps as multiply-adds over the unfolded windows, ~30% cheaper than
    # PyTorch's grouped conv1d on the CPU at this length (and dearer at prefill lengths)
    windows = joined.unfold(-1, conv.weight.shape[-1], 1)  # [S, I, L, K]
    out = (windows * conv.weight[:, 0][None, :, None, :]).sum(-1)
    return out if conv.bias is None else out + conv.bias[None, :, None]


def scan(mixer, u: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         valid: torch.Tensor, ssm_cache: torch.Tensor, step: StepState) -> torch.Tensor:
    """The selective scan's outputs [S, L, I] (float32) from each slot's state (zero for a
    fresh sequence); the slots get the state after each sequence's last position, the step's
    checkpoint slots the state after their rows."""
    A = -torch.exp(mixer.A_log.float())  # [I, N]
    state = ssm_cache[step.slots].float().masked_fill(step.fresh[:, None, None], 0)
    saves = checkpoints_by_row(step, u.device)
    outs = []
    for t in range(u.shape[1]):  # positions, every sequence at once
        dt_t = dt[:, t, :, None]  # [S, I, 1]
        nxt = torch.exp(A * dt_t) * state + dt_t * B[:, t, None, :].float() * u[:, t, :, None].float()
        state = torch.where(valid[:, t, None, None], nxt, state)
        if t in saves:
            seq, slots = saves[t]
            ssm_cache[slots] = state[seq].to(ssm_cache.dtype)
        outs.append((state.to(C.dtype) @ C[:, t, :, None]).squeeze(-1).float())
    ssm_cache[step.slots] = state.to(ssm_cache.dtype)
    return torch.stack(outs, dim=1)


def checkpoints_by_row(step: StepState, device: torch.device
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """row t -> (sequences, checkpoint slots) of the checkpoints taken after row t."""
    saves = {}
    for t in sorted(set(step.checkpoints.rows)):
        seq, slots = step.checkpoints.at_row(t - 1)
        saves[t - 1] = (torch.tensor(seq, device=device), torch.tensor(slots, device=device))
    return saves
