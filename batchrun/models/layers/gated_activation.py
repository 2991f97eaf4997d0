"""The gated activation of a SwiGLU / GeGLU feed-forward block, act(gate) * up, shared by the
dense MLP (llama.py), the routed experts (moe.py) and the experts of quantized checkpoints
(quant/experts.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine import kernels


def gated_activation(gate_up: torch.Tensor, cpu_kernels=None,
                     activation: str = "silu") -> torch.Tensor:
    """act(gate) * up of rows [gate | up], act SiLU (SwiGLU) or GELU with the tanh approximation
    (GeGLU): one pass of the CPU kernel (silu_mul / gelu_tanh_mul), or PyTorch ops."""
    intermediate = gate_up.shape[-1] // 2
    gelu = activation == "gelu_tanh"
    if cpu_kernels is not None:
        act = gate_up.new_empty((gate_up.shape[0], intermediate))
        fused = cpu_kernels.gelu_tanh_mul if gelu else cpu_kernels.silu_mul
        fused(gate_up.data_ptr(), act.data_ptr(), gate_up.shape[0], intermediate,
              kernels.kind(act.dtype), torch.get_num_threads())
        return act
    gate, up = gate_up.split(intermediate, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
