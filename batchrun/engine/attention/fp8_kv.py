"""An fp8 KV cache (--kv-cache-dtype fp8: float8 e4m3, torch.float8_e4m3fn) with one scale per
layer for K and one for V, as vLLM's k_scale / v_scale.

A layer's K rows are stored as k / k_scale rounded to e4m3 (nearest even, saturating at
+-448), V alike. Every backend reads the cache through the same identity, so none needs a
scale of its own: q . (k_scale * k8) = (scale * k_scale) q . k8, and the output, linear in V, is
v_scale * attention(v8). `attend` rounds the step's own K/V before the backend sees them, so
a fresh prefill chunk (attended from k/v, not from the cache) reads the values the cache holds:
every path attends the same fp8 values, and the cache write converts them exactly.

The scales are the layer's K and V absolute maxima on the calibration text (models/quant/
calibration.py kv_absmax, cached), times HEADROOM, over 448: values beyond what calibration saw
have that much room before they saturate, and e4m3's relative precision is the same at any
magnitude above its subnormals (2^-6 of the largest finite value). A layer's scales ride on its
cache tensors (`kv_scale` attributes of per-layer views: layers of different KV groups share
the storage, not the scales).
"""

from __future__ import annotations

from typing import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
HEADROOM = 2.0  # calibration's maxima map to 448 / HEADROOM
NAMES = {"fp8": FP8, "fp8_e4m3": FP8}


def scales_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """[layers, 2] (K, V) scales from the layers' K/V absolute maxima."""
    absmax = absmax.float()
    return torch.where(absmax > 0, absmax * HEADROOM / FP8_MAX, torch.ones_like(absmax))


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as e4m3, rounded to nearest even, saturating (torch's conversion alone turns
    values past 448 into NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def layer_caches(k: torch.Tensor, v: torch.Tensor, k_scale: float,
                 v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a layer's K/V cache tensors that carry its scales."""
    kl, vl = k.view(k.shape), v.view(v.shape)
    setattr(kl, "kv_scale", float(k_scale))
    setattr(vl, "kv_scale", float(v_scale))
    return kl, vl


def kv_scale(cache: torch.Tensor) -> float:
    """The layer scale that layer_caches attached to a cache view."""
    scale: float = getattr(cache, "kv_scale")
    return scale


def attend(forward: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
           *rest) -> torch.Tensor:
    """`forward` (a backend's, or the reference attention) over an fp8 cache with its layer's
    scales: the same arguments, the step's K/V rounded through e4m3."""
    ks, vs = kv_scale(k_cache), kv_scale(v_cache)
    k8 = quantize(k, ks).to(k.dtype)
    v8 = quantize(v, vs).to(v.dtype)
    out = forward(q, k8, v8, k_cache, v_cache, meta, scale * ks, *rest)
    return out.mul_(vs)
