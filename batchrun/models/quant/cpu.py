"""What this CPU computes fast: int8's logits dtype and the load's warning where bfloat16 has
no fast GEMM."""

from __future__ import annotations

import functools
import os

import torch

# oneDNN's ONEDNN_MAX_CPU_ISA values from the first with a bfloat16 dot product (VDPBF16PS, AMX).
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX",
                    "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL")


@functools.lru_cache(maxsize=None)
def has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16, and oneDNN not capped below them (ONEDNN_MAX_CPU_ISA, as
    benchmarks/bench.py --isa avx2 sets): oneDNN's bfloat16 GEMMs beat float32 ones several times
    over. Without, oneDNN has no bfloat16 kernel (torch will not pack bfloat16 weights for it)
    and bfloat16 GEMMs fall back to ATen's, which widen each weight to float32."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap not in ONEDNN_BF16_ISAS:
        return False
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def slow_bf16_note(dtype: torch.dtype, device: torch.device,
                   bf16_method: str | None = None) -> str | None:
    """What --dtype bfloat16 (or --quantization bf16) runs on here when the CPU has no bfloat16
    dot product (None where it has): GEMMs that widen bfloat16 to float32."""
    asked = "--dtype bfloat16" if dtype == torch.bfloat16 else \
        f"--quantization {bf16_method}" if bf16_method else None
    if asked is None or device.type != "cpu" or has_fast_bf16():
        return None
    return (f"{asked} on a CPU without AVX512-BF16 or AMX (or with oneDNN capped below them by "
            "ONEDNN_MAX_CPU_ISA): no bfloat16 dot product, so its GEMMs widen bfloat16 to "
            "float32 (PyTorch's, not oneDNN's); it reads half float32's weight bytes at float32's "
            "multiply rate")

