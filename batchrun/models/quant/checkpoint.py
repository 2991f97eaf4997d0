"""A checkpoint stored quantized (GPTQ, AWQ, compressed-tensors, FP8, MXFP4) loaded in its own
format: each projection's tensors become one of models/quant/'s layers, one layer at a time
(never the whole model in float). The formats (one file each) say how a projection's tensors
read (`Layer`; a format storing experts fused, 3-D, builds those: `ReadFused`); this file
walks the model, fuses q/k/v and gate/up as the float loading does, reads an MoE's routed
experts into quant/experts.py's per-expert layers, and refuses a quantized tensor nothing took
instead of loading garbage.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from batchrun.models.quant.errors import QuantizationError

# the checkpoint's projections the native model holds fused
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the tensors quantized formats store beside (or instead of) a projection's weight
QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_shape",
                      "weight_scale", "weight_zero_point", "weight_scale_inv", "input_scale",
                      "weight_global_scale", "input_global_scale", "weight_g_idx",
                      "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                      "down_proj_scales")


@dataclasses.dataclass
class Layer:
    """One projection's weights as a quantized layer takes them: `rows` are split along the
    output (concatenated when projections fuse), `options` must agree between fused parts."""
    make: Callable[..., nn.Module]  # make(bias=..., **rows, **options)
    rows: dict[str, torch.Tensor]
    options: dict = dataclasses.field(default_factory=dict)


class Tensors:
    """The safetensors files of a checkpoint folder, read by name one tensor at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = sorted(glob.glob(str(Path(folder) / "*.safetensors")))
        self.where: dict[str, str] = {}
        for f in self.files:
            with safe_open(f, framework="pt") as sf:
                self.where.update((key, f) for key in sf.keys())

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.where[name], framework="pt") as sf:
            return sf.get_tensor(name)

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self else None


def _targets(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, list[str]]]:
    """(parent, attribute, checkpoint prefix, the prefixes of the projections it fuses) of each
    of the model's linear layers."""
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full = f"{path}.{child_name}" if path else child_name
            prefix = full if full.startswith("lm_head") else f"model.{full}"
            base = prefix.rsplit(".", 1)[0]
            yield module, child_name, prefix, [f"{base}.{p}" for p in FUSED.get(child_name, ())]


def _check_experts_device(experts: nn.Module, base: str, method: str) -> None:
    """Quantized routed experts run on the CPU only: one layer call per expert, with a host sync
    for the runs of pairs (QuantizedExperts), no grouped quantized-expert kernel on CUDA yet."""
    device = next(experts.parameters()).device
    if device.type != "cpu":
        raise QuantizationError(f"{base}: the {method} checkpoint's routed experts are kept "
                                f"quantized on the CPU only (no grouped quantized-expert "
                                f"kernel on {device.type} yet); use --device cpu")


def _quantized(tensors: Tensors, prefix: str) -> bool:
    return any(f"{prefix}.{s}" in tensors for s in QUANTIZED_SUFFIXES)


def _same(a: dict, b: dict) -> bool:
    def equal(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y

    return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)


def _fuse(layers: list[Layer], bias: torch.Tensor | None, name: str) -> nn.Module:
    first = layers[0]
    if any(layer.make is not first.make or not _same(layer.options, first.options) for layer in layers):
        raise QuantizationError(f"{name}: its fused projections are quantized differently (group "
                                "or block sizes, layer kinds or act-order input orders differ); "
                                "batchrun runs them as one layer")
    rows = {key: torch.cat([layer.rows[key] for layer in layers]) for key in first.rows}
    return first.make(bias=bias, **rows, **first.options)


# read_fused(tensors, experts prefix, the float experts module): per expert its gate_up and down
# layers (moe.Experts' layout, biases in), or None where the checkpoint stores them float
ReadFused = Callable[[Tensors, str, nn.Module], "tuple[list[nn.Module], list[nn.Module]] | None"]


@torch.no_grad()
def load_linears(model: nn.Module, folder: Path, read: Callable[[Tensors, str], Layer],
                 method: str, convert: Callable[[nn.Module], nn.Module] | None = None,
                 read_fused: ReadFused | None = None) -> set[str]:
    """Put the layers `read(tensors, prefix)` builds (passed through `convert` when given) in
    place of each of the model's linears the checkpoint stores quantized, and the experts
    `read_fused` builds in place of fused ones; returns the checkpoint tensor names they hold
    (which the float loading then skips). A quantized tensor nothing took is a QuantizationError."""
    tensors = Tensors(folder)
    covered: set[str] = set()
    for parent, attr, own, fused in _targets(model):
        prefixes = [own] if _quantized(tensors, own) else fused
        if not prefixes or not all(_quantized(tensors, p) for p in prefixes):
            if any(_quantized(tensors, p) for p in prefixes):
                raise QuantizationError(f"{own}: only some of {prefixes} are quantized ({method}); "
                                        "batchrun runs them as one fused layer")
            continue  # a float layer (an `ignore`d lm_head, say): the float loading reads it
        biases = [tensors.get(f"{p}.bias") for p in prefixes]
        present = [b for b in biases if b is not None]
        if biases[0] is not None and len(present) < len(biases):
            raise QuantizationError(f"{own}: only some of {prefixes} have a bias")
        bias = None if biases[0] is None else torch.cat(present).float()
        layers = [read(tensors, p) for p in prefixes]
        # read on the CPU; to the replaced linear's device (CUDA: the Triton path) before any
        # requantizing, which then builds its layer there
        module = _fuse(layers, bias, own).to(getattr(parent, attr).weight.device)
        setattr(parent, attr, module if convert is None else convert(module))
        covered.update(name for name in tensors.where
                       if any(name.rsplit(".", 1)[0] == p for p in prefixes))
    from batchrun.models.quant.experts import QuantizedExperts, expert_blocks

    expert_prefixes: set[str] = set()
    for path, parent, attr, experts in expert_blocks(model):
        base = f"model.{path}.{attr}"
        if experts.per_expert_swiglu:
            found = _read_experts(tensors, base, experts.num_experts, read, method)
        else:
            blocks = None if read_fused is None else read_fused(tensors, base, experts)
            found = None if blocks is None else (*blocks, [base])
        if found is None:
            continue
        _check_experts_device(experts, base, method)
        gate_up, down, prefixes = found
        if convert is not None:
            gate_up, down = [convert(m) for m in gate_up], [convert(m) for m in down]
        setattr(parent, attr, QuantizedExperts(gate_up, down, experts.activation))
        expert_prefixes.update(prefixes)
    covered.update(name for name in tensors.where if name.rsplit(".", 1)[0] in expert_prefixes)
    left = sorted(name for name in tensors.where if name not in covered
                  and name.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES)
    if left:
        raise QuantizationError(
            f"the {method} checkpoint holds quantized tensors no linear layer of batchrun's model "
            f"takes ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): quantized "
            "experts stored fused (3-D) and other non-linear tensors are not read quantized")
    return covered


# An expert's (gate, up, down) projection names: Qwen-MoE's and OLMoE's, Mixtral's
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _read_experts(tensors: Tensors, base: str, count: int, read: Callable[[Tensors, str], Layer],
                  method: str):
    """(per expert its fused gate+up layer, its down layer, the checkpoint prefixes they hold)
    of the experts under `base` (Mixtral's under block_sparse_moe) when the checkpoint stores
    them quantized, else None."""
    found = next(((folder, names) for folder in (base, base.replace(".mlp.", ".block_sparse_moe."))
                  for names in EXPERT_NAMES if _quantized(tensors, f"{folder}.0.{names[0]}")), None)
    if found is None:
        return None
    folder, names = found
    gate_up, down, prefixes = [], [], []
    for expert in range(count):
        own = [f"{folder}.{expert}.{name}" for name in names]
        lacking = [p for p in own if not _quantized(tensors, p)]
        if lacking:
            raise QuantizationError(f"{lacking[0]} is not stored quantized ({method}) while "
                                    f"{folder}.0.{names[0]} is: batchrun reads a block's experts "
                                    "in one format")
        gate_up.append(_fuse([read(tensors, own[0]), read(tensors, own[1])], None, f"{own[0]} + {names[1]}"))
        down.append(_fuse([read(tensors, own[2])], None, own[2]))
        prefixes += own
    return gate_up, down, prefixes


def group_order(g_idx: torch.Tensor | None, group: int, where: str) -> torch.Tensor | None:
    """The input order that makes act-order groups contiguous (GPTQ's desc_act, compressed-tensors'
    "group" ordering): g_idx [K] gives each input's group; None when they already are. Sorted by
    group, the inputs must fall into groups of `group` (Int4WeightLinear's equal groups)."""
    if g_idx is None:
        return None
    k, g_idx = len(g_idx), g_idx.long()
    groups = torch.arange(k) // group
    if torch.equal(g_idx, groups):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], groups):
        raise QuantizationError(f"{where} whose groups are not all {group} inputs wide; "
                                "batchrun's int4 layers need equal groups")
    return perm


def int4_layer(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               in_perm: torch.Tensor | None = None) -> Layer:
    """An int4 projection, w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]) with g = k // group
    (k counted in `in_perm`'s order when given), as Int4WeightLinear's groups: min = -zero *
    scale (exact in float32: an fp16 or bf16 scale times an integer up to 16 fits its 24 bits)."""
    scale = scale.float()
    return Layer(_int4_module, {"q": q.to(torch.uint8), "scale": scale,
                                "minimum": -zero.float() * scale}, {"group": group, "in_perm": in_perm})


def _int4_module(bias, q, scale, minimum, group, in_perm):
    from batchrun.models.quant.int4_linear import Int4WeightLinear

    return Int4WeightLinear(None, bias, q=q, scale=scale, minimum=minimum, group=group, in_perm=in_perm)


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values out of each int32 along the last dimension: nibble i (bits 4i..4i+3)
    is value order[i] of its eight (uint8 [..., 8 * n])."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 15  # [..., n, 8] by bit position
    values = torch.empty_like(nibbles)
    values[..., list(order)] = nibbles
    return values.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def group_size(config: dict, in_features: int | None = None) -> int:
    size = int(config.get("group_size", 128))
    return in_features if size == -1 and in_features else size
