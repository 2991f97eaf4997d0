"""Rotary position embeddings as transformers computes them (every RoPE variant but dynamic
NTK; LongRoPE's short factors; partial rotary), looked up once per step; shared by the native
model files."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from batchrun.engine.kernels.ops import CpuKernels


def rope_parameters(hf, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `hf` (of its `layer_type` layers when they differ by type)."""
    params = getattr(hf, "rope_parameters", None) or {}
    return params.get(layer_type, params) if layer_type else params


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed as transformers does (all RoPE variants but
    dynamic NTK; LongRoPE's short factors, the ones transformers uses up to its original
    context), over the first rotary_dim dims of a head (partial_rotary_factor)."""
    cos: torch.Tensor  # buffers [max positions, rotary_dim]
    sin: torch.Tensor

    def __init__(self, cfg, layer_type: str | None = None):
        super().__init__()
        hf = cfg.hf_config
        params = rope_parameters(hf, layer_type)
        rope_type = params.get("rope_type", params.get("type", "default"))
        self.rotary_dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = self.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK RoPE scaling is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            extra = {"layer_type": layer_type} if layer_type else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None, **extra)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [T, 1, head_dim]; looked up once per step."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; a table narrower than the head rotates its first dims."""
        if cos.shape[-1] < x.shape[-1]:
            rot = cos.shape[-1]
            return torch.cat((RotaryEmbedding.rotate(x[..., :rot], cos, sin), x[..., rot:]), -1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


@dataclass
class StepRope:
    """A step's rotary embedding: its positions, and the cos/sin rows PyTorch ops need."""
    positions: torch.Tensor
    table: RotaryEmbedding
    dtype: torch.dtype
    kernels: CpuKernels | None = None  # the CPU kernel library; None = PyTorch ops

    @cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.table.tables(self.positions, self.dtype)


def longrope_reason(hf, layer_type: str | None = None) -> str | None:
    """Why LongRoPE would not run exactly: transformers switches every position of a forward
    call to the long factors once that call reaches past the original context, which a
    batched, chunked, prefix-cached engine cannot reproduce; only the short factors are run."""
    params = rope_parameters(hf, layer_type)
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings",
                          getattr(hf, "original_max_position_embeddings", None))
    if original is None or hf.max_position_embeddings > original:
        return (f"LongRoPE beyond the original context ({original} of "
                f"{hf.max_position_embeddings} positions: transformers switches a whole call to "
                f"the long factors past it)")
    return None
