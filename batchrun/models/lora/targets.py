"""What a LoRA adapter may target on a model: for each decoder layer, the PEFT module names of the
checkpoint's architecture (self_attn.q_proj, attention.query_key_value, ...), each as the
projection it updates and the slice of that projection's output it writes.

The native model fuses projections (one qkv_proj holds q_proj, k_proj and v_proj: three slices of
one projection) and so declares its targets (LlamaModel.lora_targets); a transformers model's are
found in its modules (`linear_targets`): every plain linear inside a decoder layer, one slice
covering its whole output, named as PEFT names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from batchrun.models.layers.bf16_gemm_linear import Bf16GemmLinear
from batchrun.models.layers.packed_linear import PackedLinear

LINEARS = (nn.Linear, PackedLinear, Bf16GemmLinear)
# Names of the decoder-layer list, most likely first, when a model holds several lists as long.
LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer", "decoder_layers")


@dataclass(frozen=True)
class Target:
    projection: str  # the module the update wraps, its path in the layer ("self_attn.qkv_proj")
    start: int  # the columns of the projection's output this PEFT module writes
    end: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.end - self.start


@dataclass
class LoraTargets:
    """The targetable modules of one model, keyed (layer, path in the layer) by PEFT's names."""

    layers_path: str  # the decoder layers' full module name in the checkpoint ("model.layers")
    layers: nn.ModuleList
    targets: dict[tuple[int, str], Target]
    # Every other module of the model, full name -> class name: what a refusal names.
    others: dict[str, str] = field(default_factory=dict)

    def full_name(self, layer: int, path: str) -> str:
        return f"{self.layers_path}.{layer}.{path}"

    def module_names(self) -> list[str]:
        """The short names an adapter may target (q_proj, ...), in model order."""
        return list(dict.fromkeys(path.rsplit(".", 1)[-1] for _, path in self.targets))

    def parse(self, module_name: str) -> tuple[int, str] | None:
        """(layer, path) of a full module name inside a decoder layer; None outside them."""
        m = re.fullmatch(rf"{re.escape(self.layers_path)}\.(\d+)\.(.+)", module_name)
        return None if m is None else (int(m[1]), m[2])


def decoder_layers(root: nn.Module, decoder: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """(full name in `root`, the list) of `decoder`'s decoder layers: its ModuleList of
    `num_layers` modules (named layers, h, ... where it holds more than one); ValueError if none."""
    prefix = next((name for name, m in root.named_modules() if m is decoder), None)
    if prefix is None:
        raise ValueError("its decoder is not a module of the model")
    lists = [(name, m) for name, m in decoder.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == num_layers and name]
    if not lists:
        raise ValueError(f"no list of its {num_layers} decoder layers was found")
    rank = {n: i for i, n in enumerate(LAYER_LIST_NAMES)}
    name, layers = min(lists, key=lambda nm: rank.get(nm[0].rsplit(".", 1)[-1], len(rank)))
    return (f"{prefix}.{name}" if prefix else name), layers


def linear_targets(root: nn.Module, decoder: nn.Module, num_layers: int) -> LoraTargets:
    """Every plain linear of `decoder`'s layers as a target of its own, named as in `root` (the
    model PEFT wraps)."""
    layers_path, layers = decoder_layers(root, decoder, num_layers)
    targets: dict[tuple[int, str], Target] = {}
    for i, layer in enumerate(layers):
        for path, module in layer.named_modules():
            if isinstance(module, LINEARS):
                targets[(i, path)] = Target(path, 0, module.out_features, module.in_features)
    inside = {id(m) for m in layers.modules()}
    others = {name: type(m).__name__ for name, m in root.named_modules()
              if name and not (id(m) in inside and isinstance(m, LINEARS))}
    return LoraTargets(layers_path, layers, targets, others)
