"""What this CPU computes fast, for the weight-only layers' choice of compute dtype."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: oneDNN's bfloat16 GEMMs beat float32 ones several times over."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def weight_only_dtype(activations: torch.dtype) -> torch.dtype:
    """Weight-only layers dequantize into bfloat16 and run a bfloat16 GEMM (float32 in, float32
    out) where the CPU has fast bfloat16; else they compute in the activations' dtype."""
    return torch.bfloat16 if activations == torch.float32 and has_fast_bf16() else activations
