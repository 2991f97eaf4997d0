"""An int8 KV cache (--kv-cache-dtype int8): each (token, KV head) row of K and of V stored as
int8 with its own float32 scale (largest |x| of the row / 127, rounded to nearest), the scales
in a [slots, kv heads] tensor beside the pool (`row_scales` on the cache tensor: per slot, so
layers sharing a pool share them like the data). No calibration: a row's scale is its own.

Per-row scales cannot be folded into the query or the output as fp8_kv.py's per-layer ones
are, so the readers apply them: the C kernels multiply a tile's scores by the keys' scales and
its softmax weights by the values' (kernels/paged_attention.c), the PyTorch paths dequantize
what they gather (kv_write.read_rows). `attend` rounds the step's own K/V through int8 first,
so a fresh prefill chunk attends what the cache holds, as with fp8.
"""

from __future__ import annotations

from typing import Callable

import torch

INT8 = torch.int8
SCALE_BYTES = 4  # a float32 per (token, KV head) row, for K and for V


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., D], float32 scales [...]) of x [..., D], a scale per last-dim row."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (xf / scale[..., None]).round_().clamp_(-127, 127).to(INT8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def layer_caches(k: torch.Tensor, v: torch.Tensor, k_scales: torch.Tensor,
                 v_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a pool's K/V tensors that carry their row scales [slots, kv heads]."""
    kl, vl = k.view(k.shape), v.view(v.shape)
    kl.row_scales, vl.row_scales = k_scales, v_scales
    return kl, vl


def attend(forward: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
           *rest) -> torch.Tensor:
    """`forward` over an int8 cache: the same arguments, the step's K/V rounded through int8."""
    return forward(q, dequantize(*quantize_rows(k), k.dtype), dequantize(*quantize_rows(v), v.dtype),
                   k_cache, v_cache, meta, scale, *rest)
