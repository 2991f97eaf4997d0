"""Griffin's recurrent block (transformers' RecurrentGemmaRecurrentBlock: a short causal
convolution and the Real-Gated Linear Recurrent Unit, gated by a GeLU branch) over the engine's
state slots, for a step's packed sequences at once, laid out and convolved as mamba.py does.

RG-LRU per position: a = exp(-8 r softplus(Λ)) with r the recurrence gate, h = a h + sqrt(1 -
a^2) (i x) with i the input gate; at a sequence's first position (position 0, transformers'
reset) a is 0 and the input is not scaled. The gates are block-diagonal over heads. A padding
position leaves the state as it is.

One sequence's state: the convolution's last width - 1 inputs [lru_width, width - 1] in the
model's dtype and the recurrence's state [lru_width] in float32, as transformers keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StateTensor, StepState
from batchrun.models.transformers.mamba import causal_conv

MIXER = "RecurrentGemmaRecurrentBlock"


def state_tensors(block, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    return (StateTensor((block.lru_width, block.conv1d_width - 1), dtype),
            StateTensor((block.lru_width,), torch.float32))


def forward(block, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> tuple[torch.Tensor, None]:
    """The block's (output [1, T, hidden], None) for the step's flat rows `hidden` [1, T,
    hidden], updating the slots of `tensors` (conv state, recurrence state)."""
    conv_cache, lru_cache = tensors
    x = hidden[0]
    y = block.act_fn(block.linear_y(x))
    rows, valid = step.padded_rows()
    xb = (block.linear_x(x)[rows] * valid[..., None]).transpose(1, 2)
    xb = causal_conv(xb, block.conv_1d, conv_cache, step).transpose(1, 2).to(x.dtype)
    first = step.fresh[:, None] & (torch.arange(rows.shape[1], device=rows.device) == 0)
    a, inputs = gated(block.rg_lru, xb, first)
    state = lru_cache[step.slots].masked_fill(step.fresh[:, None], 0)
    outs = []
    for t in range(rows.shape[1]):  # positions, every sequence at once
        nxt = a[:, t].float() * state + inputs[:, t].float()
        state = torch.where(valid[:, t, None], nxt, state)
        outs.append(nxt.to(x.dtype))
    lru_cache[step.slots] = state
    h = torch.stack(outs, dim=1)[valid]
    return block.linear_out(h * y)[None], None


def gated(lru, act: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the recurrence's a [S, L, W], its gated and normalised input [S, L, W]) of the
    convolved activations `act` [S, L, W]; `first` [S, L]: a sequence's position 0."""
    S, L, width = act.shape
    heads = act.reshape(S, L, lru.num_attention_heads, lru.block_width)
    input_gate = torch.sigmoid(torch.einsum("slhi,hij->slhj", heads, lru.input_gate_weight)
                               + lru.input_gate_bias).reshape(S, L, width)
    recurrence_gate = torch.sigmoid(
        torch.einsum("slhi,hij->slhj", heads, lru.recurrent_gate_weight)
        + lru.recurrent_gate_bias).reshape(S, L, width)
    log_a = -8.0 * recurrence_gate * F.softplus(lru.recurrent_param)
    scale = torch.sqrt(1 - torch.exp(2 * log_a)).masked_fill(first[..., None], 1.0)
    inputs = act * input_gate * scale.to(act.dtype)
    return torch.exp(log_a).masked_fill(first[..., None], 0.0), inputs
