"""AWQ int4 checkpoints (quant_method "awq", the GEMM packing) as Int4WeightLinear's groups,
exactly.

Per projection: qweight int32 [K, N/8], eight output columns a word in AWQ's interleaved order
(nibble i, bits 4i..4i+3, holds column ORDER[i] of its eight), qzeros int32 [G, N/8] packed the
same way, scales [G, N]: w[n, k] = scales[k // group, n] * (q[k, n] - z[k // group, n]).
"""

from __future__ import annotations

from batchrun.models.quant.errors import QuantizationError
from batchrun.models.quant.checkpoint import Layer, Tensors, int4_layer, unpack_int32
from batchrun.models.quant.int4_linear import Int4WeightLinear

METHOD = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _bits(config: dict):
    return config.get("bits", config.get("w_bit"))


def _group(config: dict) -> int:
    return int(config.get("group_size", config.get("q_group_size", 128)))


def check(config: dict) -> None:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"AWQ version {version!r}: batchrun reads AWQ's GEMM packing only")
    if _bits(config) != 4:
        raise QuantizationError(f"AWQ with {_bits(config)}-bit weights: batchrun runs 4-bit AWQ only")
    if not config.get("zero_point", True):
        raise QuantizationError("AWQ without zero points: batchrun reads zero-point AWQ only")
    if _group(config) == -1:
        raise QuantizationError("AWQ without groups (group_size -1): batchrun reads grouped AWQ only")


def describe(config: dict) -> str:
    return f"awq int4 (groups of {_group(config)}, gemm packing)"


def nbytes(config: dict, out_features: int, in_features: int) -> int:
    return Int4WeightLinear.nbytes(out_features, in_features, _group(config))


def read(tensors: Tensors, prefix: str, config: dict) -> Layer:
    q = unpack_int32(tensors[f"{prefix}.qweight"], ORDER)  # [K, N]
    zero = unpack_int32(tensors[f"{prefix}.qzeros"], ORDER)[:, :q.shape[1]]  # [G, N]
    return int4_layer(q.T.contiguous(), tensors[f"{prefix}.scales"].T, zero.T.float(), _group(config))
