"""A stored quantized checkpoint's routed experts (GPTQ, AWQ, compressed-tensors, FP8 MoE models;
GPT-OSS's MXFP4), kept quantized: each expert's gate and up projections are one of the format's
linear layers (fused, as the dense MLP's), its down projection another. A step runs only the experts it routes
tokens to, each on its own run of the (token, expert) pairs sorted by expert, so memory stays at
the format's size and the work at the routed pairs'; the cost beside moe.Experts' grouped GEMM
is one layer call per active expert.
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.engine.kernels import fallback_ops
from batchrun.models.layers.grouped_gemm import ExpertPairs, route


class QuantizedExperts(nn.Module):
    """moe.Experts' forward over per-expert quantized layers: gate_up[e] maps hidden to
    [gate | up] (2 * intermediate), down[e] intermediate to hidden; between them SwiGLU, or the
    `activation` module of the float experts replaced (GPT-OSS's clamped one)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module],
                 activation: nn.Module | None = None):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up_proj, self.down_proj = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.activation = activation

    def activate(self, gate_up: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        if self.activation is not None:
            return self.activation(gate_up, cpu_kernels)
        return fallback_ops.gated_mul(gate_up, "silu", cpu_kernels)

    def project(self, rows: torch.Tensor, which: str, pairs: ExpertPairs, cpu_kernels=None) -> torch.Tensor:
        layers = getattr(self, which)
        bounds, active = pairs.bounds.tolist(), pairs.active.tolist()
        parts = [layers[e](rows[start:end]) for e, start, end in zip(active, bounds, bounds[1:])]
        return torch.cat(parts) if parts else rows.new_empty((0, layers[0].out_features))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                cpu_kernels=None) -> torch.Tensor:
        return route(self, x, experts, weights, cpu_kernels)


def expert_blocks(model: nn.Module):
    """(path, parent, attribute, module) of each routed-experts block of `model` (moe.Experts:
    `per_expert_swiglu` when checkpoints store one SwiGLU expert at a time, not GPT-OSS's)."""
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if hasattr(child, "per_expert_swiglu"):
                yield path, module, name, child
