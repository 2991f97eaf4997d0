"""LFM2's short convolution (transformers' Lfm2ShortConv: gated, B·x convolved over the last few
positions, gated by C) over the engine's state slots, for a step's packed sequences at once, as
mamba.py lays them out. One sequence's state: the convolution's last L_cache - 1 inputs
[hidden, L_cache - 1]."""

from __future__ import annotations

import torch

from batchrun.engine.state_slots import StateTensor, StepState
from batchrun.models.transformers.mamba import causal_conv

MIXER = "Lfm2ShortConv"
WRITES_CHECKPOINTS = True  # causal_conv writes the step's state checkpoints


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    return (StateTensor((mixer.conv.in_channels, mixer.conv_kernel_size - 1), dtype),)


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> torch.Tensor:
    """The layer's output [1, T, hidden] for the step's flat rows `hidden` [1, T, hidden],
    updating the step's sequences' slots of its convolution state."""
    (conv_cache,) = tensors
    B, C, x = mixer.in_proj(hidden[0]).chunk(3, dim=-1)  # [T, hidden] each
    rows, valid = step.padded_rows()
    bx = ((B * x)[rows] * valid[..., None]).transpose(1, 2)  # [S, hidden, L]
    y = C[rows] * causal_conv(bx, mixer.conv, conv_cache, step).transpose(1, 2).to(C.dtype)
    return mixer.out_proj(y[valid])[None]
