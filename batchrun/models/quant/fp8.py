"""FP8 checkpoints of quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3 / Qwen3
FP8): weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)] for
weight_block_size [bn, bk]: w = weight * scale_inv of its block. Run as Fp8WeightLinear (float8
bytes, float activations: the checkpoint's dynamic fp8 activations are not emulated)."""

from __future__ import annotations

from batchrun.models.quant.errors import QuantizationError
from batchrun.models.quant.checkpoint import Layer, Tensors
from batchrun.models.quant.fp8_linear import Fp8WeightLinear, fp8_layer

METHOD = "fp8"


def _block(config: dict) -> tuple[int, int] | None:
    block = config.get("weight_block_size")
    return None if block is None else (int(block[0]), int(block[1]))


def check(config: dict) -> None:
    fmt = str(config.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise QuantizationError(f"FP8 weights in {fmt!r}: batchrun reads e4m3 only")


def describe(config: dict) -> str:
    block = _block(config)
    return f"fp8 e4m3 weights ({'blocks of %dx%d' % block if block else 'per tensor'}), float activations"


def nbytes(config: dict, out_features: int, in_features: int) -> int:
    block = _block(config)
    return Fp8WeightLinear.nbytes(out_features, in_features, block[1] if block else in_features)


def read(tensors: Tensors, prefix: str, config: dict) -> Layer:
    scale = tensors.get(f"{prefix}.weight_scale_inv")
    if scale is None:
        scale = tensors[f"{prefix}.weight_scale"]
    return fp8_layer(tensors[f"{prefix}.weight"], scale, _block(config))
