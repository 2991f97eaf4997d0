"""float8 e4m3 (e4m3fn) bytes widened to float32 with integer ops, for GPUs whose Triton has no
e4m3 type (before sm_89: `tl.float8e4nv` does not compile there).

A byte s eeee mmm is (-1)^s (1 + m/8) 2^(e-7) for e > 0 and (-1)^s m 2^-9 for e = 0 (0x7f / 0xff,
NaN, are never written by batchrun's quantizers, which saturate at 448). A normal value's float32
bits are the same fields moved: sign to bit 31, exponent rebiased by 120, mantissa to bit 20.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def e4m3_native(device: torch.device) -> bool:
    """Whether Triton has the e4m3 type here: the interpreter, or a GPU of sm_89+."""
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def e4m3_to_float32(byte):
    """float32 values of uint8 e4m3 bytes (any shape)."""
    b = byte.to(tl.int32)
    sign = b >> 7
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))
    return tl.where(exponent > 0, normal, subnormal)
