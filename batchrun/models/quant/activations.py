"""Per-token dynamic int8 quantization of activations: each row x[i] becomes
round(x[i] / s[i]) with s[i] = max|x[i]| / 127, so every token uses the int8 range fully."""

from __future__ import annotations

import torch

_TINY = 1e-12  # an all-zero row gets this scale instead of 0 (its int8 values are all 0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 scales [M, 1]) of a float [M, K]."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY).div_(127.0)
    return torch.round(x / scale).to(torch.int8), scale
