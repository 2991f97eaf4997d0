"""The low-rank update on the base projections, for the rows of a step that run on an adapter.

The base projection (a packed or plain Linear, possibly fused: the native qkv_proj, gate_up_proj)
runs once over all the step's rows; then each contiguous run of rows on one adapter ("segment")
adds x[run] @ A^T @ (scaling * B)^T to its output. A projection is updated per slice (targets.py:
the PEFT modules it holds, one for an unfused linear): the A matrices of the slices the adapter
targets are stacked, so one GEMM shrinks the rows for all of them, and each slice's B expands its
own columns in place. Segmented beats gathering A and B per row (a batched matmul over rows) on
the CPU by a wide margin (`python benchmarks/lora.py --kernels`): a segment is two small GEMMs, a
gather copies r x in weights for every row.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from batchrun.models.lora.stacked import StackedUpdates, stack_updates, stacked_segments
from batchrun.models.lora.targets import LoraTargets
from batchrun.models.lora.updates import ProjectionUpdate, SliceUpdate


@dataclass
class StepAdapters:
    """What the LoRA layers read: the adapters' updates by slot, and this step's segments."""

    # slot -> (layer, projection) -> update; a slot of a resident adapter.
    updates: dict[int, dict[tuple[int, str], ProjectionUpdate]] = field(default_factory=dict)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end, slot)


class LoraLinear(nn.Module):
    """A base projection plus the low-rank update of the step's adapter rows. The rows are the
    step's flat row of tokens: [T, in], or [1, T, in] as a transformers model passes them."""

    def __init__(self, base: nn.Module, layer: int, projection: str, step: StepAdapters):
        super().__init__()
        self.base = base
        self.key = (layer, projection)
        self.step = step
        self._stacked: StackedUpdates | None = None  # the CUDA path's stacks of the adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.step.segments:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        divided_by = getattr(self.base, "input_divided_by", None)  # a smoothed int8 base's
        if divided_by is not None:  # (models/quant/smoothquant.py): the adapter reads the true input
            flat_x = flat_x * divided_by.to(flat_x.dtype)
        if flat_x.is_cuda:
            self._update_batched(flat_x, flat_y)
            return y
        for start, end, slot in self.step.segments:
            update = self.step.updates[slot].get(self.key)
            if update is None:
                continue
            shrunk = flat_x[start:end] @ update.a_t
            rows = flat_y[start:end]
            for s in update.slices:
                rows[:, s.out_start:s.out_end].addmm_(shrunk[:, s.rank_start:s.rank_end], s.b_t)
        return y

    def _update_batched(self, flat_x: torch.Tensor, flat_y: torch.Tensor) -> None:
        """Every segment's update in one shrink and one expand launch (engine/kernels/triton_lora.py)."""
        from batchrun.engine.kernels.triton_lora import lora_update

        by_slot = {slot: u[self.key] for slot, u in self.step.updates.items() if self.key in u}
        if not by_slot:
            return
        if self._stacked is None or not self._stacked.current(by_slot):
            self._stacked = stack_updates(by_slot, flat_y.shape[1])
        table, max_rows = stacked_segments(self.step.segments, self._stacked, flat_x.device)
        lora_update(flat_x, flat_y, self._stacked.a_t, self._stacked.b_t, table, max_rows)


def wrap_projections(targets: LoraTargets, projections: set[tuple[int, str]],
                     step: StepAdapters) -> None:
    """Put a LoraLinear around each of these (layer, projection path) of the model."""
    for index, path in projections:
        parent_path, _, name = path.rpartition(".")
        layer = targets.layers[index]
        parent = layer.get_submodule(parent_path) if parent_path else layer
        base = getattr(parent, name)
        if not isinstance(base, LoraLinear):
            setattr(parent, name, LoraLinear(base, index, path, step))


def projections_of(targets: LoraTargets, modules) -> set[tuple[int, str]]:
    """The (layer, projection) that hold any of these (layer, PEFT module path)."""
    return {(layer, targets.targets[(layer, path)].projection) for layer, path in modules}


def projection_updates(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                       scaling: float, targets: LoraTargets, device: torch.device,
                       dtype: torch.dtype) -> dict[tuple[int, str], ProjectionUpdate]:
    """An adapter's (layer, PEFT module path) -> (A, B) as updates of the model's projections."""
    by_projection: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    for layer, path in sorted(weights, key=lambda k: (k[0], targets.targets[k].start)):
        by_projection[(layer, targets.targets[(layer, path)].projection)].append((layer, path))
    out: dict[tuple[int, str], ProjectionUpdate] = {}
    for key, present in by_projection.items():
        a_parts, slices, col = [], [], 0
        for where in present:
            a, b = weights[where]
            target = targets.targets[where]
            a_parts.append(a)
            b_t = (b.to(torch.float32) * scaling).t().to(device, dtype).contiguous()
            slices.append(SliceUpdate(target.start, target.end, col, col + a.shape[0], b_t))
            col += a.shape[0]
        out[key] = ProjectionUpdate(torch.cat(a_parts).t().to(device, dtype).contiguous(), slices)
    return out
