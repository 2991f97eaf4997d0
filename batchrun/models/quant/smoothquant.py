"""`--quantization int8` at load: calibrated SmoothQuant smoothing plus float outlier channels.

On the float model (weights loaded, linears still nn.Linear), per decoder layer:

- qkv_proj and gate_up_proj read a norm's output: s divides that norm's weight (and a
  LayerNorm's bias; free at run time) and multiplies the linear's weight columns.
- o_proj (reads attention's output) and down_proj (reads act(gate) * up): 1/s is applied to the
  activations inside the layer, in the same elementwise pass that zeroes its outlier channels
  (so it costs nothing extra). Folding it upstream instead would need v_proj rows (o_proj; not
  possible where grouped-query heads share a v head but want different factors) or up_proj rows.
- Each linear's OUTLIERS input channels with the largest calibrated maxima run in a bfloat16 GEMM
  (float32 sums) beside the int8 one.

- The logits layer (lm_head, or the tied embeddings) reads the final norm's output, which is also
  the hidden state that pooling returns: smoothed like o_proj, inside the layer (LOGITS), with
  LOGITS_OUTLIERS bfloat16 channels. The plain int8 logits layer cost +0.85% perplexity; this one
  measured within the gate's noise of float32 logits, at 2.3x a bfloat16 GEMM's speed.

s = smoothing_factors(calibrated max|x|, weight, ALPHA). benchmarks/int8_smoothing.py chose
ALPHA 0.5 on the bundled model, and the quality gate OUTLIERS (benchmarks/quality.py, 16
windows: 16 channels 96.94% top-1, 32 97.72%, 64 98.06%; README). MoE models: the attention linears only
(their MLP's norm also feeds the router and the float experts). The remaining linears are
quantized plainly by quantize_linears afterwards.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from batchrun.models.quant.decoder import as_decoder
from batchrun.models.quant.smoothing import smoothing_factors

log = logging.getLogger(__name__)

ALPHA = 0.5
OUTLIERS = 32
LOGITS = "logits"  # the calibration's name for the logits layer's input (the final hidden state)
LOGITS_OUTLIERS = 32  # benchmarks/quality.py: 16 gave 96.60% top-1, 32 97.06% (README)


def targets(model: nn.Module) -> dict[str, tuple[nn.Linear, nn.Module | None]]:
    """{qualified linear name: (linear, the norm whose output it reads, or None)}: each
    layer's projections as the model's layout declares them (models/layers/projections.py) that
    are plain linears (an MoE layer's experts are not)."""
    decoder = as_decoder(model)
    found: dict[str, tuple[nn.Linear, nn.Module | None]] = {}
    for i, layer in enumerate(decoder.layers):
        for p in decoder.layout.projections:
            linear = _submodule(layer, p.name)
            if isinstance(linear, nn.Linear):
                norm = None if p.norm is None else _submodule(layer, p.norm)
                found[f"layers.{i}.{p.name}"] = (linear, norm)
    return found


def _submodule(layer, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def smoothed_bytes(out_features: int, in_features: int, outliers: int = OUTLIERS) -> int:
    """What a smoothed Int8Linear holds beyond a plain one: its outlier channels' bfloat16 weight
    columns (padded to an even count) and int64 indices, and two float32 vectors over its input
    (the factors, and the activations' multiplier that zeroes the outlier channels)."""
    return 2 * out_features * (outliers + outliers % 2) + 8 * outliers + 8 * in_features


@torch.no_grad()
def smooth_and_quantize(model: nn.Module, input_max: dict[str, torch.Tensor]) -> int:
    """Replace the target linears by smoothed Int8Linear layers (folding s into their norms);
    returns how many."""
    from batchrun.models.quant.int8_linear import Int8Linear

    count = 0
    for name, (linear, norm) in targets(model).items():
        weight = linear.weight.detach().float()
        maxima = input_max[name]
        s = smoothing_factors(maxima, weight, ALPHA)
        outliers = torch.topk(maxima, min(OUTLIERS, len(maxima))).indices.sort().values
        layer: nn.Module
        if norm is not None:
            for param in (norm.weight, getattr(norm, "bias", None)):  # a LayerNorm's bias too
                if isinstance(param, torch.Tensor):
                    param.div_(s.to(param.dtype))
            layer = Int8Linear(weight * s, linear.bias, outliers=outliers, input_divided_by=s)
        else:
            layer = smoothed_in_layer(linear, maxima)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        count += 1
    if LOGITS in input_max:
        maxima = input_max[LOGITS]
        decoder = as_decoder(model)
        logits_weight = (decoder.embed_tokens if decoder.lm_head is None else decoder.lm_head).weight
        assert isinstance(logits_weight, torch.Tensor)
        weight = logits_weight.detach().float()
        outliers = torch.topk(maxima, min(LOGITS_OUTLIERS, len(maxima))).indices.sort().values
        model.lm_head = Int8Linear(weight, None, smooth=smoothing_factors(maxima, weight, ALPHA),
                                   outliers=outliers)
        count += 1
    return count


def smoothed_in_layer(linear: nn.Linear, maxima: torch.Tensor) -> nn.Module:
    """`linear` as an Int8Linear applying 1/s to its input itself, with OUTLIERS bfloat16
    channels, from its calibrated input maxima (o_proj's and down_proj's form; every linear of
    a transformers-backend model: models/transformers/quantized.py)."""
    from batchrun.models.quant.int8_linear import Int8Linear

    weight = linear.weight.detach().float()
    outliers = torch.topk(maxima, min(OUTLIERS, len(maxima))).indices.sort().values
    return Int8Linear(weight, linear.bias, smooth=smoothing_factors(maxima, weight, ALPHA),
                      outliers=outliers)


def has_logits_layer(model: nn.Module) -> bool:
    """Whether the model computes logits (a sequence classifier has a `score` head instead)."""
    return not getattr(model, "num_labels", 0) and hasattr(model, "lm_head")


def prepare_int8(model: nn.Module, files: list[Path], tokenizer_path: Path) -> int:
    """Calibrate (or read the cached calibration) and put the smoothed int8 layers in place."""
    from batchrun.models.quant.calibration import input_maxima

    found = targets(model)
    maxima = input_maxima(model, {n: lin for n, (lin, _) in found.items()}, files, tokenizer_path,
                          "int8", LOGITS if has_logits_layer(model) else None)
    log.info("int8: smoothing and quantizing %d linear layers", len(found))
    return smooth_and_quantize(model, maxima)
