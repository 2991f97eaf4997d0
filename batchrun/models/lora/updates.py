"""An adapter's update of one (possibly fused) projection, as the LoRA layers read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
