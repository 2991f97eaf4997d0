"""compressed-tensors checkpoints (llm-compressor's; quant_method "compressed-tensors"), each
projection by the scheme of the config group that targets it:

- pack-quantized int4 weights (W4A16; groups or per channel): weight_packed int32 [N, K/8],
  value j of a row in bits 4(j%8).. of word j//8, stored as q + 8; weight_scale [N, G]; for
  asymmetric schemes weight_zero_point int32 [N/8, G] packed the same way down the output:
  w = scale * (q - zero) -> Int4WeightLinear's groups, exactly.
- int-quantized int8 weights (weight int8 [N, K], symmetric, weight_scale per channel or
  tensor): with dynamic per-token int8 activations (W8A8) Int8Linear, without (W8A16)
  Int8WeightLinear, the checkpoint's int8 values and scales as they are. Static activation
  scales (input_scale) are not used: batchrun quantizes activations per token at run time.
- float-quantized FP8 e4m3 weights (per tensor, per channel or block): Fp8WeightLinear, float
  activations.

Activation ordering: "weight" (alias "static") changes only how the weights were calibrated,
not their format; "group" (alias "dynamic", deprecated by llm-compressor but in published int4
checkpoints) stores weight_g_idx [K], each input's group, the groups' inputs apart: loaded as
GPTQ's act-order is, the inputs sorted by group (the layer gathers them in that order).
Sparse (2:4) checkpoints, other bit widths and formats are refused with the reason.
"""

from __future__ import annotations

import re

import torch

from batchrun.models.quant.errors import QuantizationError
from batchrun.models.quant.checkpoint import Layer, Tensors, group_order, int4_layer, unpack_int32
from batchrun.models.quant.fp8_linear import Fp8WeightLinear, fp8_layer

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


def _schemes(config: dict) -> list[dict]:
    return list((config.get("config_groups") or {}).values())


def _kind(scheme: dict, config: dict) -> str:
    """int4, int8 (W8A8), int8-weight or fp8 (ValueError with the reason otherwise)."""
    weights = scheme.get("weights") or {}
    acts = scheme.get("input_activations")
    fmt = scheme.get("format") or config.get("format")
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} (batchrun reads {', '.join(FORMATS)})")
    if weights.get("actorder") not in (None, "static", "weight", "group", "dynamic"):
        raise ValueError(f"act-order {weights.get('actorder')!r} weights")
    if _grouped_order(weights) and not (bits == 4 and weights.get("strategy") == "group"):
        raise ValueError(f"act-order {weights.get('actorder')!r} on {bits}-bit {kind} "
                         f"{weights.get('strategy')} weights (int4 groups only)")
    if kind == "float":
        if bits != 8:
            raise ValueError(f"{bits}-bit float weights")
        return "fp8"
    if bits == 4 and weights.get("strategy") in ("group", "channel") and (
            acts is None or acts.get("type") == "float"):
        return "int4"
    if bits == 8 and weights.get("symmetric", True) and weights.get("strategy") in ("channel", "tensor"):
        if acts is None:
            return "int8-weight"
        if acts.get("type", "int") == "int" and acts.get("num_bits") == 8 and acts.get("symmetric", True):
            return "int8"
    raise ValueError(f"{bits}-bit {kind} weights ({weights.get('strategy')}, symmetric "
                     f"{weights.get('symmetric', True)}) with activations {acts}")


def _grouped_order(weights: dict) -> bool:
    return weights.get("actorder") in ("group", "dynamic")


def check(config: dict) -> None:
    if config.get("sparsity_config"):
        raise QuantizationError("a sparse compressed-tensors checkpoint (sparsity_config): "
                                "batchrun reads dense quantized weights only")
    if not _schemes(config):
        raise QuantizationError("a compressed-tensors checkpoint without config_groups")
    for scheme in _schemes(config):
        try:
            _kind(scheme, config)
        except ValueError as exc:
            raise QuantizationError(f"compressed-tensors {exc}: batchrun runs W4A16 int4 "
                                    "(pack-quantized), W8A8 / W8A16 int8 and FP8 e4m3 weights") from None


def _scheme(config: dict, prefix: str) -> dict:
    for scheme in _schemes(config):
        for target in scheme.get("targets", ()):
            if target == "Linear" or prefix.endswith(target) or (
                    target.startswith("re:") and re.match(target[3:], prefix)):
                return scheme
    raise QuantizationError(f"compressed-tensors: no config group targets {prefix}, which the "
                            "checkpoint stores quantized")


def describe(config: dict) -> str:
    names = {"int4": "int4 weights (W4A16)", "int8": "int8 weights and per-token activations (W8A8)",
             "int8-weight": "int8 weights (W8A16)", "fp8": "fp8 e4m3 weights, float activations"}
    return "compressed-tensors " + ", ".join(sorted({names[_kind(s, config)] for s in _schemes(config)}))


def nbytes(config: dict, out_features: int, in_features: int) -> int:
    """As the first config group's scheme stores a layer (the one that targets Linear, usually
    the only one)."""
    from batchrun.models.quant.int4_linear import Int4WeightLinear
    from batchrun.models.quant.int8_linear import Int8Linear, Int8WeightLinear

    scheme = _schemes(config)[0]
    weights = scheme["weights"]
    kind = _kind(scheme, config)
    if kind == "int4":
        group = weights.get("group_size") if weights.get("strategy") == "group" else in_features
        order = in_features * 8 if _grouped_order(weights) else 0  # the int64 input order
        return Int4WeightLinear.nbytes(out_features, in_features, group) + order
    if kind == "fp8":
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return Fp8WeightLinear.nbytes(out_features, in_features, block[1] if block else in_features)
    return (Int8Linear if kind == "int8" else Int8WeightLinear).nbytes(out_features, in_features)


def read(tensors: Tensors, prefix: str, config: dict) -> Layer:
    scheme = _scheme(config, prefix)
    weights, kind = scheme["weights"], _kind(scheme, config)
    scale = tensors[f"{prefix}.weight_scale"]
    g_idx = tensors.get(f"{prefix}.weight_g_idx")
    if kind != "int4" and g_idx is not None and bool((g_idx.long() != torch.sort(g_idx.long()).values).any()):
        raise QuantizationError(f"{prefix}: act-order weight_g_idx on {kind} weights")
    if kind == "fp8":
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return fp8_layer(tensors[f"{prefix}.weight"], scale, tuple(block) if block else None)
    if kind == "int4":
        n, k = (int(v) for v in tensors[f"{prefix}.weight_shape"])
        q = unpack_int32(tensors[f"{prefix}.weight_packed"])[:, :k]
        scale = scale.reshape(n, -1)
        if weights.get("symmetric", True):
            zero = torch.full(scale.shape, 8.0)
        else:  # packed down the output dimension, stored as zero + 8 as the weights are
            zero = unpack_int32(tensors[f"{prefix}.weight_zero_point"].T.contiguous())[:, :n].T.float()
        group = k // scale.shape[1]
        perm = group_order(g_idx, group, f"{prefix}: a weight_g_idx")
        if perm is not None:
            q = q[:, perm]
        return int4_layer(q, scale, zero, group, perm)
    qweight = tensors[f"{prefix}.weight"]
    if qweight.dtype != torch.int8:
        raise QuantizationError(f"{prefix}: int8 weights stored as {qweight.dtype}")
    scale = scale.float().reshape(-1).expand(qweight.shape[0]).contiguous() if scale.numel() == 1 \
        else scale.float().reshape(-1)
    return Layer(_int8_module if kind == "int8" else _int8_weight_module,
                 {"qweight": qweight, "scale": scale})


def _int8_module(bias, qweight, scale):
    from batchrun.models.quant.int8_linear import Int8Linear

    return Int8Linear(None, bias, qweight=qweight, scale=scale)


def _int8_weight_module(bias, qweight, scale):
    from batchrun.models.quant.int8_linear import Int8WeightLinear

    return Int8WeightLinear(None, bias, qweight=qweight, scale=scale)
