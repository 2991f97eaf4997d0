"""W8A8 int8 weights laid out for the AMX-INT8 kernel (engine/kernels/int8_amx.c).

On a CPU with AMX-INT8, Int8Linear multiplies with that kernel instead of oneDNN's int8 linear:
1.1-2.3x faster over 30 layers of the bundled model's shapes with the weights streaming from
memory, 1 to 1,024 rows (`python benchmarks/int8_gemms.py --threads 2`, Xeon with AMX), and
exact: the zero point's share of the uint8 activations comes out in int32, so it gives
oneDNN's VNNI path's bits.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from batchrun.models.quant.cpu import cpu_flags

DEPTH = 64  # inputs a tile row holds: the kernel takes in_features a multiple of it


def expected(in_features: int) -> bool:
    """Whether an Int8Linear of this depth will run on the AMX kernel here: AMX-INT8 in the CPU,
    the C kernels on, and no cap below AMX (ONEDNN_MAX_CPU_ISA or BATCHRUN_SIMD, as
    `bench.py --isa` sets them; a VNNI cap then runs oneDNN's VNNI kernels as asked). Decided
    when the layer is built, so it holds one layout; a library without the tiles after all
    (no compiler, an old kernel) repacks it for oneDNN (Int8Linear.kernel_gemm)."""
    from batchrun.engine import kernels

    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return (in_features % DEPTH == 0 and "amx_int8" in cpu_flags() and kernels.enabled()
            and (not cap or "AMX" in cap or cap == "ALL") and not kernels.simd_cap())


def held_bytes(out_features: int, in_features: int) -> int:
    """Bytes the layout holds: the weights with their rows padded to 16, their int32 sums."""
    return -(-out_features // 16) * 16 * in_features + out_features * 4


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [n, k] as the kernel reads it: [ceil(n / 16)][k / 4][16][4] (n padded with zeros)."""
    n, k = q.shape
    blocks = -(-n // 16)
    padded = F.pad(q, (0, 0, 0, blocks * 16 - n))
    return padded.view(blocks, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse: int8 [n, k]."""
    blocks = -(-n // 16)
    return packed.view(blocks, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(blocks * 16, k)[:n].contiguous()
