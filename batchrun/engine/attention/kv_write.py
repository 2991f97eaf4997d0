"""Writing a step's K/V rows into the paged cache (every backend's first step), and reading
rows back as floats (the PyTorch paths' gathers)."""

from __future__ import annotations

import torch

from batchrun.engine.attention import int8_kv
from batchrun.engine.attention.int8_kv import INT8, dequantize, row_scales


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, lib=None) -> None:
    """k/v [T, Hkv, D] into the cache's slots; through the C kernel `lib` (one pass, converting
    the dtype; an int8 cache's rows quantized with their scales, int8_kv.store) when given and
    the rows' layout allows it, else index_copy_ (same result)."""
    if k_cache.dtype == INT8:
        int8_kv.store(k_cache, slot_mapping, k, lib)
        int8_kv.store(v_cache, slot_mapping, v, lib)
        return
    if lib is not None and k.stride(0) == v.stride(0) \
            and k.stride()[1:] == v.stride()[1:] == (k.shape[2], 1):
        lib.kv_write(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_rows(k_cache, slot_mapping, k)
        store_rows(v_cache, slot_mapping, v)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots] = rows in the cache's dtype (index_copy_; an fp8 cache through its bytes,
    which index_copy_ takes where it does not take fp8 itself; an int8 cache with each row's
    scale, int8_kv.py)."""
    if cache.dtype == INT8:
        int8_kv.store(cache, slots, rows)
    elif cache.element_size() == 1:
        cache.view(torch.uint8).index_copy_(0, slots, rows.to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows.to(cache.dtype))


def read_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] as `dtype` (an int8 cache dequantized by its row scales; an fp8 cache's
    values unscaled: fp8_kv.py folds its layer scales into the query and the output)."""
    if cache.dtype == INT8:
        return dequantize(cache[slots], row_scales(cache)[slots], dtype)
    return cache[slots].to(dtype)
