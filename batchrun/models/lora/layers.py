"""The low-rank update on the base projections, for the rows of a step that run on an adapter.

The base projection (a packed or plain Linear, possibly fused: qkv, gate_up) runs once over all
the step's rows; then each contiguous run of rows on one adapter ("segment") adds
x[run] @ A^T @ (scaling * B)^T to its output. A fused projection is updated per slice: the A
matrices of the slices the adapter targets are stacked, so one GEMM shrinks the rows for all of
them, and each slice's B expands its own columns in place. Segmented beats gathering A and B per
row (a batched matmul over rows) on the CPU by a wide margin (`python benchmarks/lora.py
--kernels`): a segment is two small GEMMs, a gather copies r x in weights for every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from batchrun.models.lora.adapter import LoraError

# Our fused projections: name -> the PEFT modules it holds, in output order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
          "down_proj": "mlp"}


@dataclass
class SliceUpdate:
    out_start: int  # columns of the projection's output this slice writes
    out_end: int
    rank_start: int  # columns of the shrunk rows it reads
    rank_end: int
    b_t: torch.Tensor  # (scaling * B)^T, [r, out]


@dataclass
class ProjectionUpdate:
    """One adapter's update of one (possibly fused) projection."""

    a_t: torch.Tensor  # stacked A^T of the targeted slices, [in, r * slices]
    slices: list[SliceUpdate]


@dataclass
class StepAdapters:
    """What the LoRA layers read: the adapters' updates by slot, and this step's segments."""

    # slot -> (layer, projection) -> update; a slot of a resident adapter.
    updates: dict[int, dict[tuple[int, str], ProjectionUpdate]] = field(default_factory=dict)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end, slot)


class LoraLinear(nn.Module):
    """A base projection plus the low-rank update of the step's adapter rows."""

    def __init__(self, base: nn.Module, layer: int, projection: str, step: StepAdapters):
        super().__init__()
        self.base = base
        self.key = (layer, projection)
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for start, end, slot in self.step.segments:
            update = self.step.updates[slot].get(self.key)
            if update is None:
                continue
            shrunk = x[start:end] @ update.a_t
            rows = y[start:end]
            for s in update.slices:
                rows[:, s.out_start:s.out_end].addmm_(shrunk[:, s.rank_start:s.rank_end], s.b_t)
        return y


def wrap_projections(model: nn.Module, projections: set[str], step: StepAdapters) -> None:
    """Put a LoraLinear around each of these projections (qkv_proj, ...) of every layer."""
    for index, layer in enumerate(model.layers):
        for name in projections:
            parent = getattr(layer, PARENT[name])
            base = getattr(parent, name, None)
            if base is None:  # an MoE layer: its experts are 3-D tensors, not one projection
                raise LoraError(f"layer {index} has no {name} (a mixture-of-experts layer); "
                                "LoRA on MoE models applies to attention projections only")
            if not isinstance(base, LoraLinear):
                setattr(parent, name, LoraLinear(base, index, name, step))


def slice_offsets(cfg) -> dict[str, dict[str, tuple[int, int]]]:
    """projection -> PEFT module -> its output columns in our (fused) projection."""
    q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv_proj": {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)},
            "o_proj": {"o_proj": (0, cfg.hidden_size)},
            "gate_up_proj": {"gate_proj": (0, i), "up_proj": (i, 2 * i)},
            "down_proj": {"down_proj": (0, cfg.hidden_size)}}


def projection_updates(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                       scaling: float, cfg, device: torch.device,
                       dtype: torch.dtype) -> dict[tuple[int, str], ProjectionUpdate]:
    """An adapter's (layer, PEFT module) -> (A, B) as updates of our fused projections."""
    offsets = slice_offsets(cfg)
    out: dict[tuple[int, str], ProjectionUpdate] = {}
    for layer in sorted({layer for layer, _ in weights}):
        for projection, modules in FUSED.items():
            present = [m for m in modules if (layer, m) in weights]
            if not present:
                continue
            a_parts, slices, col = [], [], 0
            for m in present:
                a, b = weights[(layer, m)]
                start, end = offsets[projection][m]
                a_parts.append(a)
                b_t = (b.to(torch.float32) * scaling).t().to(device, dtype).contiguous()
                slices.append(SliceUpdate(start, end, col, col + a.shape[0], b_t))
                col += a.shape[0]
            a_t = torch.cat(a_parts).t().to(device, dtype).contiguous()
            out[(layer, projection)] = ProjectionUpdate(a_t, slices)
    return out


def projections_of(modules) -> set[str]:
    """Our projections that hold any of these PEFT modules."""
    return {p for p, ms in FUSED.items() if set(ms) & set(modules)}
