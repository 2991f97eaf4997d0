"""Qwen3-Next's linear attention (transformers' Qwen3NextGatedDeltaNet) over the engine's flat
step row and its state slots (engine/state_slots.py).

A step's rows belong to several sequences, each continuing its own slot: the depthwise causal
convolution over q|k|v reads each sequence's last kernel - 1 inputs from its slot before its
rows (`causal_conv`, on the packed rows: no padding to the longest), the gated delta rule
(engine/kernels/gated_delta.py: C on the CPU, Triton on CUDA, else PyTorch's chunked form)
continues each sequence's [heads, dk, dv] state, and a gated RMS norm and the output projection
follow. A fresh sequence (its first chunk) reads zeros whatever its slot holds. A step with
state checkpoints (prefix caching) runs in pieces ending at them
(engine/state_checkpoint_pieces.py), each piece's final states copied into its checkpoints.

One sequence's state, both float32 (the convolution's inputs are the model's dtype's values, so
float32 holds them exactly; the delta rule's state accumulates over the whole sequence): the
convolution's last inputs [kernel - 1, conv_dim] and the recurrent state [Hv, dk, dv].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine import state_checkpoint_pieces
from batchrun.engine.kernels.gated_delta import gated_delta_rule
from batchrun.engine.state_slots import StateTensor, StepState


@dataclass(frozen=True)
class DeltaShape:
    hidden_size: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def state_tensors(self) -> tuple[StateTensor, ...]:
        return (StateTensor((self.conv_kernel - 1, self.conv_dim), torch.float32),
                StateTensor((self.v_heads, self.k_dim, self.v_dim), torch.float32))


class GatedRMSNorm(nn.Module):
    """RMS norm over each head's dv values, times the weight, times silu(z) (norm before gate,
    the float32 steps where transformers takes them)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.dtype == z.dtype == torch.float32:  # the same steps fused: half the time
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps).mul_(F.silu(z))
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(z.float())).to(dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                step: StepState) -> torch.Tensor:
    """The depthwise causal convolution [T, C] (no activation) of the packed rows x [T, C], each
    sequence's rows after its slot's last inputs conv_state [slots, K - 1, C] (zeros for a fresh
    sequence); the slots get each sequence's last K - 1 inputs. weight [C, K]: tap j reads the
    input K - 1 - j positions back."""
    keep, n_seq = weight.shape[1] - 1, len(step.slots)
    before = conv_state[step.slots].masked_fill(step.fresh[:, None, None], 0).to(x.dtype)
    joined = torch.cat([before.reshape(n_seq * keep, -1), x])  # slots' rows, then the step's
    seq = torch.repeat_interleave(torch.arange(n_seq, device=x.device), step.counts)
    offset = torch.arange(x.shape[0], device=x.device) - step.query_start[seq]

    def rows(seq_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Rows of `joined` holding position `at` of each sequence's [kept inputs, its rows]."""
        return torch.where(at < keep, seq_ids * keep + at,
                           n_seq * keep + step.query_start[seq_ids] + at - keep)

    out = sum(joined[rows(seq, offset + j)] * weight[:, j] for j in range(keep + 1))
    last = step.counts[:, None] + torch.arange(keep, device=x.device)  # [S, keep]
    ids = torch.arange(n_seq, device=x.device)[:, None].expand_as(last)
    conv_state[step.slots] = joined[rows(ids, last)].to(conv_state.dtype)
    assert isinstance(out, torch.Tensor)
    return out


def conv_silu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, step: StepState,
              kernels=None) -> torch.Tensor:
    """silu(causal_conv(...)): the C kernel (engine/kernels/causal_conv.c) on float32 rows, one
    pass instead of causal_conv's gathers and temporaries."""
    if kernels is not None and x.dtype == torch.float32 and conv_state.is_contiguous():
        return kernels.causal_conv_silu(x, weight, conv_state, step.slots, step.query_start,
                                        step.fresh)
    return F.silu(causal_conv(x, weight, conv_state, step))


class GatedDeltaNet(nn.Module):
    """The mixer with transformers' parameter names (in_proj_qkvz, in_proj_ba, conv1d, dt_bias,
    A_log, norm, out_proj); in_proj_qkvz's rows interleave q, k, v, z per key head group, as
    the checkpoints store them."""

    def __init__(self, shape: DeltaShape):
        super().__init__()
        s = self.shape = shape
        self.in_proj_qkvz = nn.Linear(s.hidden_size, s.conv_dim + s.v_heads * s.v_dim, bias=False)
        self.in_proj_ba = nn.Linear(s.hidden_size, 2 * s.v_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim,
                                bias=False, padding=s.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(s.v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.v_heads))
        self.norm = GatedRMSNorm(s.v_dim, s.eps)
        self.out_proj = nn.Linear(s.v_heads * s.v_dim, s.hidden_size, bias=False)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv]) of the rows h."""
        s, t = self.shape, h.shape[0]
        r = s.v_heads // s.k_heads
        qkvz = self.in_proj_qkvz(h).view(t, s.k_heads, -1)
        q, k, v, z = qkvz.split([s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim], dim=-1)
        b, a = self.in_proj_ba(h).view(t, s.k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, s.v_heads, s.v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, h: torch.Tensor, step: StepState, tensors: tuple[torch.Tensor, ...],
                kernels=None) -> torch.Tensor:
        """The mixer's output [T, hidden] of the step's rows h [T, hidden], continuing (and
        updating) the slots of `tensors` (conv state, recurrent state)."""
        if len(step.checkpoints):  # the kernels keep final states only: pieces ending at them
            return state_checkpoint_pieces.run(
                step, tensors, lambda rows, piece: self.forward(h[rows], piece, tensors, kernels))
        s, t = self.shape, h.shape[0]
        conv_state, recurrent = tensors
        mixed, z, b, a = self.project(h)
        mixed = conv_silu(mixed, self.conv1d.weight[:, 0], conv_state, step, kernels)
        q, k, v = mixed.split([s.k_heads * s.k_dim, s.k_heads * s.k_dim, s.v_heads * s.v_dim], -1)
        q, k = (l2norm(x.float().view(t, s.k_heads, s.k_dim)) for x in (q, k))
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if bool(step.fresh.any()):
            recurrent[step.slots[step.fresh]] = 0
        o = gated_delta_rule(q * s.k_dim ** -0.5, k, v.float().view(t, s.v_heads, s.v_dim), g,
                             beta, recurrent, step.slots, step.query_start, step.max_count,
                             kernels)
        out = self.norm(o.to(h.dtype), z)
        return self.out_proj(out.reshape(t, -1))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) along the last dimension (transformers' and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's mixer: the same maths, its input projections stored apart and in the
    convolution's order (in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a)."""

    def __init__(self, shape: DeltaShape):
        super().__init__(shape)
        s = shape
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = nn.Linear(s.hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, s.v_heads * s.v_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.v_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.v_heads, bias=False)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = self.in_proj_z(h).view(h.shape[0], self.shape.v_heads, self.shape.v_dim)
        return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
