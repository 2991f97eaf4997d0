"""Llama 4's attention temperature tuning on the flat step: its NoPE layers scale each query by
1 + attn_scale * log1p(floor((p + 1) / floor_scale)) of its position p. Transformers' modelling
code takes p from its own cache's length plus the row's index, which on the backend's step of
many sequences (and no transformers cache) is not the row's position; so the backend turns the
modules' own scaling off and applies it in the attention function from the step's positions,
with the same float32 arithmetic."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

ATTRIBUTE = "batchrun_temperature"  # (floor_scale, attn_scale) on a module the backend scales


def take_over(model: nn.Module) -> int:
    """Move every temperature-tuned attention module's scaling to `tune`; how many."""
    count = 0
    for module in model.modules():
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope",
                                                                             True):
            scales = (float(getattr(module, "floor_scale")), float(getattr(module, "attn_scale")))
            setattr(module, ATTRIBUTE, scales)
            setattr(module, "attn_temperature_tuning", False)
            count += 1
    return count


def tune(module: nn.Module, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] of the step's rows at `positions` [T], scaled as the module's own forward
    would scale them (unchanged for a module take_over did not touch)."""
    scales = getattr(module, ATTRIBUTE, None)
    if scales is None:
        return q
    floor_scale, attn_scale = scales
    factor = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * factor.to(q.device)[:, None, None]).to(q.dtype)


@contextlib.contextmanager
def restored(model: nn.Module):
    """The modules' own temperature tuning back for the duration (transformers' own forward:
    the load check's reference, the int8 calibration), off again afterwards."""
    taken = [m for m in model.modules() if hasattr(m, ATTRIBUTE)]
    for module in taken:
        setattr(module, "attn_temperature_tuning", True)
    try:
        yield
    finally:
        for module in taken:
            setattr(module, "attn_temperature_tuning", False)
