"""An int8 KV cache (--kv-cache-dtype int8): each (token, KV head) row of K and of V stored as
int8 with its own float32 scale (largest |x| of the row / 127, rounded to nearest), the scales
in a [slots, kv heads] tensor beside the pool (`row_scales` on the cache tensor: per slot, so
layers sharing a pool share them like the data). No calibration: a row's scale is its own.

Per-row scales cannot be folded into the query or the output as fp8_kv.py's per-layer ones
are, so the readers apply them: the C kernels multiply a tile's scores by the keys' scales and
its softmax weights by the values' (kernels/paged_attention.c), the PyTorch paths dequantize
what they gather (kv_write.read_rows). `attend` rounds the step's own K/V through int8 first,
so a fresh prefill chunk attends what the cache holds, as with fp8; and the query alike (a scale
per token and head, as llama.cpp's q8_0 KV does), which lets the C kernel score an int8 key
against it with VNNI int8 dot products (every path and backend sees the same rounded query). On the CPU the rows are
quantized (and rounded) by the C kernel int8_kv_rows in one pass each, the same values as
quantize_rows.
"""

from __future__ import annotations

from typing import Callable

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what int8_kv_rows reads
INT8 = torch.int8
SCALE_BYTES = 4  # a float32 per (token, KV head) row, for K and for V


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., D], float32 scales [...]) of x [..., D], a scale per last-dim row: max|x| / 127
    (1 for a zero row), q = round(x * (127 / max|x|)), as the C kernel int8_kv_rows computes."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    nonzero = amax > 0
    scale = torch.where(nonzero, amax / 127, 1.0)
    # a true division (127 / tensor is 127 * reciprocal in PyTorch, rounded twice)
    inv = torch.where(nonzero, amax.new_full(amax.shape, 127.0).div_(amax), 1.0)
    return (xf * inv[..., None]).round_().clamp_(-127, 127).to(INT8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def _kernel_takes(lib, rows: torch.Tensor) -> bool:
    """Whether the C kernel can read rows [T, heads, D] where they lie: on the CPU, in a float
    dtype it reads, each token's heads side by side."""
    return lib is not None and rows.device.type == "cpu" and rows.shape[-1] <= 1024 \
        and rows.dtype in KERNEL_DTYPES and rows.stride()[1:] == (rows.shape[2], 1)


def round_trip(x: torch.Tensor, lib=None) -> torch.Tensor:
    """x [T, heads, D] as an int8 cache hands it back (quantized and dequantized per row)."""
    if not _kernel_takes(lib, x):
        return dequantize(*quantize_rows(x), x.dtype)
    out = lib.int8_round_trip(x)  # float32
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, lib=None) -> None:
    """cache[slots] = rows [T, heads, D] quantized, their scales into cache.row_scales."""
    if not _kernel_takes(lib, rows):
        q, scale = quantize_rows(rows)
        cache.index_copy_(0, slots, q)
        row_scales(cache).index_copy_(0, slots, scale)
        return
    lib.int8_kv_store(rows, slots, cache, row_scales(cache))


def layer_caches(k: torch.Tensor, v: torch.Tensor, k_scales: torch.Tensor,
                 v_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a pool's K/V tensors that carry their row scales [slots, kv heads]."""
    kl, vl = k.view(k.shape), v.view(v.shape)
    setattr(kl, "row_scales", k_scales)
    setattr(vl, "row_scales", v_scales)
    return kl, vl


def row_scales(cache: torch.Tensor) -> torch.Tensor:
    """The scales [slots, kv heads] that layer_caches attached to a cache view."""
    scales: torch.Tensor = getattr(cache, "row_scales")
    return scales


def attend(forward: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
           *rest) -> torch.Tensor:
    """`forward` over an int8 cache: the same arguments, the step's K/V rounded through int8,
    and the query too (per token and head), as the C kernel scores with int8 dot products."""
    lib = getattr(meta, "lib", None)  # the CPU kernels' metadata carries their library
    return forward(round_trip(q, lib), round_trip(k, lib), round_trip(v, lib), k_cache, v_cache,
                   meta, scale, *rest)
