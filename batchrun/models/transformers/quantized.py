"""--quantization on the transformers backend: the decoder's linear layers become models/quant/'s
modules, as the native path's do, before the probe forward (model.wrap) checks that the model
still runs. What stays float: the vision tower and projector of a vision-language model, the
logits layer, and MoE routers and classifier heads (quant.KEEP_FLOAT); experts held as 3-D
tensors stay float as on the native path.

int8 is calibrated as on the native path (quant/calibration.py: the shipped text through the
float model once, cached), but every linear takes the in-layer form of SmoothQuant (1/s applied
to its input in the pass that zeroes its bfloat16 outlier channels: the native o_proj's), since
the native path's folding of s into a norm needs to know which norm feeds which linear.
`--quantization gguf` and checkpoints stored quantized need the native path.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Iterable

import torch
from torch import nn

from batchrun.models.transformers.support import UnsupportedModelError
from batchrun.models.quant.methods import Method

if TYPE_CHECKING:  # transformers' modelling code loads with the backend
    from transformers import PreTrainedModel


def decoder_linears(hf: PreTrainedModel, keep: Collection[str] = ()) -> dict[str, nn.Linear]:
    """{qualified name in `hf`: linear} of the decoder's linears --quantization replaces: not
    those named in KEEP_FLOAT, nor those in `keep` (the ones its modelling code uses directly:
    plain_linears.py)."""
    from batchrun.models.quant import kept_float

    decoder = hf.get_decoder()  # a vision-language model's: its language model
    prefix = next(name for name, m in hf.named_modules() if m is decoder)
    linears = {f"{prefix}.{name}" if prefix else name: (name, m)
               for name, m in decoder.named_modules() if isinstance(m, nn.Linear)}
    return {full: m for full, (name, m) in linears.items()
            if not kept_float(name) and full not in keep}


def quantize_decoder(hf: PreTrainedModel, how: Method, path: Path, keep: Collection[str] = ()) -> int:
    """Quantize the decoder linears of transformers' model `hf` (loaded from `path`) by
    `how`, but those named in `keep`; how many."""
    if not how.on_backend:
        raise UnsupportedModelError(f"--quantization {how.name} keeps a GGUF's blocks on the "
                                    "native path only; this model runs on the transformers backend")
    linears = decoder_linears(hf, keep)
    if not linears:
        raise UnsupportedModelError(f"{hf.config.model_type}: --quantization {how.name} found no "
                                    "linear layers in its decoder to quantize")
    if how.calibrates:
        from batchrun.models.quant.smoothquant import smoothed_in_layer

        maxima = _calibrate(hf, linears, Path(path))
        made = {name: smoothed_in_layer(linear, maxima[name]) for name, linear in linears.items()}
    else:
        make = how.linear_class()
        made = {name: make(linear.weight.float(), linear.bias) for name, linear in linears.items()}
    for name, module in made.items():
        parent, _, child = name.rpartition(".")
        setattr(hf.get_submodule(parent), child, module)
    return len(made)


@torch.no_grad()
def _calibrate(hf: PreTrainedModel, linears: dict[str, nn.Linear], path: Path) -> dict[str, torch.Tensor]:
    """The calibrated input maxima of `linears`: each window of the calibration text through
    the decoder with PyTorch's SDPA attention (wrap sets the engine's afterwards)."""
    from batchrun.models.quant.calibration import input_maxima

    decoder = hf.get_decoder()

    def run(windows: Iterable[list[int]]) -> None:
        try:
            hf.set_attn_implementation("sdpa")
        except (ValueError, ImportError):  # a model without an SDPA path
            hf.set_attn_implementation("eager")
        for ids in windows:
            decoder(input_ids=torch.tensor([ids]), use_cache=False)

    files = [Path(f) for f in sorted(glob.glob(str(path / "*.safetensors")))]
    return input_maxima(hf, linears, files, path, "int8-transformers-backend", run=run)
