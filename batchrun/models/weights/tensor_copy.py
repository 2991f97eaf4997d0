"""A checkpoint tensor copied into the parameter it fills, checked first: torch's copy_ would
broadcast a smaller tensor and cast an integer one without a word, giving a model whose weights
are not the checkpoint's."""

from __future__ import annotations

import torch


def copy_into(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """target.copy_(tensor); ValueError naming the weight when its shape is not exactly
    target's or it holds integers or booleans where the model keeps floats."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"weight {name!r} has shape {list(tensor.shape)}; the config makes it "
                         f"{list(target.shape)}")
    if target.is_floating_point() and not tensor.is_floating_point():
        raise ValueError(f"weight {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}"
                         "; the model needs floating-point values")
    target.copy_(tensor)
