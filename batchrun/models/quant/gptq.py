"""GPTQ int4 checkpoints (quant_method "gptq") as Int4WeightLinear's groups, exactly.

Per projection: qweight int32 [K/8, N] (input rows 8r..8r+7 of column n in one word, row 8r+i
in bits 4i..4i+3), qzeros int32 [G, N/8] (eight output columns a word, the same order), scales
[G, N], g_idx int32 [K] (each input row's group): w[n, k] = scales[g, n] * (q[k, n] - z[g, n])
with g = g_idx[k] (act-order: g_idx permuted, each group's inputs apart; read by gathering the
inputs sorted by group, Int4WeightLinear's in_perm). The original packing (checkpoint_format
"gptq") stores z - 1 in qzeros, so z is the stored value + 1; "gptq_v2" stores z itself.
"""

from __future__ import annotations

from batchrun.models.quant.errors import QuantizationError
from batchrun.models.quant.checkpoint import Layer, Tensors, group_order, group_size, int4_layer, unpack_int32
from batchrun.models.quant.int4_linear import Int4WeightLinear

METHOD = "gptq"


def _format(config: dict) -> str:
    return str(config.get("checkpoint_format") or config.get("format") or "gptq")


def check(config: dict) -> None:
    bits = config.get("bits")
    if bits != 4:
        raise QuantizationError(f"GPTQ with {bits}-bit weights: batchrun's int4 layers run 4-bit "
                                "GPTQ only")
    if _format(config) not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"GPTQ checkpoint_format {_format(config)!r}: batchrun reads the "
                                "gptq and gptq_v2 packings only")


def describe(config: dict) -> str:
    size = config.get("group_size", 128)
    order = ", act-order" if config.get("desc_act") else ""
    return (f"gptq int4 ({'per channel' if size == -1 else f'groups of {size}'}, "
            f"{'symmetric' if config.get('sym', True) else 'asymmetric'}{order}, {_format(config)})")


def nbytes(config: dict, out_features: int, in_features: int) -> int:
    """Int4WeightLinear's bytes, and with desc_act its int64 input order (as for a permuted g_idx)."""
    order = in_features * 8 if config.get("desc_act") else 0
    return Int4WeightLinear.nbytes(out_features, in_features, group_size(config, in_features)) + order


def read(tensors: Tensors, prefix: str, config: dict) -> Layer:
    qweight = tensors[f"{prefix}.qweight"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = group_size(config, k)
    q = unpack_int32(qweight.T.contiguous())  # [N, K]
    # act-order (desc_act): the layer gathers its inputs in group order
    perm = group_order(tensors.get(f"{prefix}.g_idx"), group, f"{prefix}: a GPTQ g_idx")
    if perm is not None:
        q = q[:, perm]
    zero = unpack_int32(tensors[f"{prefix}.qzeros"])[:, :n].T.float()  # [N, G]
    if _format(config) == "gptq":
        zero = zero + 1
    return int4_layer(q, tensors[f"{prefix}.scales"].T, zero, group, perm)
