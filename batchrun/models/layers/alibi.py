"""ALiBi (attention with linear biases: BLOOM, Falcon's alibi variant, MPT): no position
embedding; each head's score of a key gains slope * (key position - query position), which the
attention (engine/attention: paged_attention(alibi=slopes)) adds. What a native ALiBi model's
layers read for a step in place of StepRope."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """float32 [num_heads]: the geometric slopes of the ALiBi paper, 2^(-8 i / n) for the
    largest power of two n <= num_heads, then every other slope of 2n's sequence for the rest
    (as transformers' BLOOM and Falcon compute them, in float32)."""
    n = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2.0 ** (-8.0 / n), dtype=torch.float32, device=device)
    slopes = base ** torch.arange(1, n + 1, device=device, dtype=torch.int32)
    if n < num_heads:
        extra = torch.tensor(2.0 ** (-4.0 / n), dtype=torch.float32, device=device)
        odd = torch.arange(1, 1 + 2 * min(n, num_heads - n), 2, device=device, dtype=torch.int32)
        slopes = torch.cat([slopes, extra ** odd])
    return slopes


class NoRope(nn.Module):
    """Stands where a RoPE model holds its tables (llm.py rebuilds model.rope by its class):
    an ALiBi model has none."""

    def __init__(self, cfg=None):
        super().__init__()


@dataclass
class StepAlibi:
    """A step's positional input to an ALiBi model's layers: the slopes per head (on the step's
    device) and the CPU kernel library (None: PyTorch ops), as StepRope carries it."""

    slopes: torch.Tensor
    kernels: object | None = None
