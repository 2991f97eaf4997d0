"""A GGUF checkpoint's linear layers loaded in their own format, never the whole model in float.

Block types unpack exactly into integer groups (gguf_blocks.py): Q4_0, Q4_1 and Q4_K into
Int4WeightLinear (4-bit q, groups of 32 with scale and min), Q8_0, Q5_K and Q6_K into
GroupedInt8Linear (int8 q, groups of 32 or 16). `--quantization gguf` runs every projection
that way (float-typed ones stay float; any other block type is refused, naming the tensor);
`int4-weight` runs the 4-bit types exactly and requantizes the rest from the gguf package's
dequantisation, one layer at a time, as every other method does.

The q/k rows are un-permuted as gguf_weights.py does for the float conversion, and q/k/v (and
gate/up) are stacked into the model's fused projections; parts of different formats (llama.cpp's
Q4_K_M stores attn_v as Q6_K beside Q4_K q/k) become a StackedLinear of one module per format.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from batchrun.models.weights.gguf_weights import read_header, unpermute
from batchrun.models.weights.loader import GGUF_SOURCE as SOURCE_FILE  # the .gguf a converted folder came from
from batchrun.models.quant.decoder import as_decoder, as_stored
from batchrun.models.quant import gguf_blocks as blocks
from batchrun.models.layers.projections import LLAMA
from batchrun.models.quant.methods import Method
from batchrun.models.quant.gguf_blocks import Groups

FLOAT_KINDS = {0: "F32", 1: "F16", 30: "BF16"}
PERMUTED_ARCHS = {"llama"}  # GGUF architectures whose q/k rows llama.cpp stores permuted
# GGUF files hold Llama-architecture models (weights/gguf_weights.py): their projections' names
_GGUF_PARTS = tuple(p.gguf for p in LLAMA.projections if p.gguf)


def source_of(folder: Path) -> Path | None:
    """The .gguf a converted model folder came from, when it still exists."""
    f = Path(folder) / SOURCE_FILE
    if not f.is_file():
        return None
    source = Path(f.read_text().strip())
    return source if source.is_file() else None


def kind_name(kind: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


class GgufLinears:
    """The linear tensors of a GGUF file, read one at a time."""

    def __init__(self, path: Path):
        self.meta, tensors, self.start = read_header(path)
        self.arch = self.meta.get("general.architecture", "llama")
        self.tensors = {name: (dims, kind, offset) for name, dims, kind, offset in tensors}
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def kind(self, name: str) -> int:
        return self.tensors[name][1]

    def raw(self, name: str) -> tuple[np.ndarray, int, int]:
        from gguf.constants import GGML_QUANT_SIZES
        from gguf import GGMLQuantizationType

        dims, kind, offset = self.tensors[name]
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        cols, rows = dims[0], int(np.prod(dims[1:]))
        nbytes = rows * cols // block * block_bytes
        return self.data[self.start + offset:self.start + offset + nbytes], rows, cols

    def _heads(self, part: str) -> int | None:
        """The head count to un-permute a q/k tensor's rows by: llama.cpp permutes them for its
        `llama` architecture only (Llama, Mistral), as transformers' GGUF loading assumes."""
        if self.arch not in PERMUTED_ARCHS:
            return None
        p = f"{self.arch}.attention."
        if part == "attn_q":
            return self.meta[p + "head_count"]
        if part == "attn_k":
            return self.meta.get(p + "head_count_kv", self.meta[p + "head_count"])
        return None

    def float_weight(self, name: str, part: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw, rows, cols = self.raw(name)
        values = dequantize(raw.reshape(rows, -1), GGMLQuantizationType(self.kind(name)))
        values = np.asarray(values, dtype=np.float32).reshape(rows, cols)
        heads = self._heads(part)
        return torch.from_numpy(np.ascontiguousarray(unpermute(values, heads) if heads else values))

    def groups(self, name: str, part: str) -> Groups:
        """The tensor's integer groups (gguf_blocks), rows in the model's order."""
        raw, rows, cols = self.raw(name)
        g = blocks.groups(raw, self.kind(name), rows, cols)
        heads = self._heads(part)
        if heads:
            def reorder(a: np.ndarray) -> np.ndarray:
                return np.ascontiguousarray(unpermute(a, heads))

            g = Groups(reorder(g.q), reorder(g.scale), None if g.min is None else reorder(g.min),
                       g.group)
        return g


class StackedLinear(nn.Module):
    """Modules side by side along the output: a fused projection whose parts are stored in
    different formats."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(as_stored(p).out_features for p in parts)
        self.in_features = as_stored(parts[0]).in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.weight.detach().float() if isinstance(p, nn.Linear)
                          else as_stored(p).dequantized_weight().float() for p in self.parts])


def family_of(kind: int) -> str:
    """Which module holds a block type exactly: int4, int8/32, int8/16 (group size) or float."""
    if kind in blocks.INT4:
        return "int4"
    if kind == blocks.Q6_K:
        return "int8/16"
    return "int8/32" if kind in blocks.INT8 else "float"


def module_of(family: str, items: list) -> nn.Module:
    """The module of consecutive parts of one family (float weights, or Groups)."""
    from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear
    from batchrun.models.quant.int4_linear import Int4WeightLinear

    if family == "float":
        layer = nn.Linear(items[0].shape[1], sum(f.shape[0] for f in items), bias=False, device="meta")
        layer.weight = nn.Parameter(torch.cat(items), requires_grad=False)
        return layer
    gs: list[Groups] = items
    q = torch.from_numpy(np.concatenate([g.q for g in gs]))
    scale = torch.from_numpy(np.concatenate([g.scale for g in gs]))
    mins = None
    if any(g.min is not None for g in gs):
        mins = torch.from_numpy(np.concatenate([np.zeros_like(g.scale) if g.min is None else g.min
                                                for g in gs]))
    if family == "int4":
        return Int4WeightLinear(None, None, q=q, scale=scale, minimum=mins)
    return GroupedInt8Linear(q, scale, mins, gs[0].group)


def _check_kind(gguf: GgufLinears, name: str) -> int:
    """The tensor's block type; refused, naming the tensor, where it has no exact form here."""
    from batchrun.models.quant import QuantizationError

    kind = gguf.kind(name)
    if not blocks.supported(kind) and kind not in FLOAT_KINDS:
        raise QuantizationError(
            f"--quantization gguf: tensor {name} is {kind_name(kind)}, which is not loaded in "
            f"its own format (supported: {', '.join(blocks.NAMES.values())} and float); use "
            "--quantization int4-weight / int8-weight (requantized) or none (float32)")
    return kind


def own_format(gguf: GgufLinears, names: list[str], parts: tuple[str, ...]) -> nn.Module:
    """One module for a fused projection's tensors in their own formats (a StackedLinear where
    they differ); refuses a block type it has no exact form for, naming the tensor."""
    items = []
    for name, part in zip(names, parts):
        family = family_of(_check_kind(gguf, name))
        items.append((family, gguf.float_weight(name, part) if family == "float" else gguf.groups(name, part)))
    return stacked(items)


def stacked(items: Sequence[tuple[str, object]]) -> nn.Module:
    """One module for (family, float weight or Groups) parts along the output: consecutive parts
    of a family in one module, a StackedLinear where the families differ."""
    runs: list[tuple[str, list]] = []
    for family, item in items:
        if runs and runs[-1][0] == family:
            runs[-1][1].append(item)
        else:
            runs.append((family, [item]))
    modules = [module_of(f, parts) for f, parts in runs]
    return modules[0] if len(modules) == 1 else StackedLinear(modules)


# an MoE block's routed experts in a GGUF: 3-D tensors [experts, out, in], gate and up fused per expert
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _expert_rows(item, expert: int, rows: int):
    """One expert's rows of a 3-D tensor read as 2-D (Groups, or a float weight)."""
    cut = slice(expert * rows, (expert + 1) * rows)
    if isinstance(item, torch.Tensor):
        return item[cut]
    return Groups(item.q[cut], item.scale[cut], None if item.min is None else item.min[cut], item.group)


def own_format_experts(gguf: GgufLinears, layer: int, experts: int) -> nn.Module:
    """quant/experts.QuantizedExperts of layer `layer`'s routed experts in their own formats."""
    from batchrun.models.quant.experts import QuantizedExperts

    names = [f"blk.{layer}.{p}.weight" for p in _EXPERT_PARTS]
    kinds = [family_of(_check_kind(gguf, n)) for n in names]
    gate, up, down = (gguf.float_weight(n, p) if k == "float" else gguf.groups(n, p)
                      for n, p, k in zip(names, _EXPERT_PARTS, kinds))
    inter, hidden = (len(t if isinstance(t, torch.Tensor) else t.q) // experts for t in (gate, down))
    gate_up = [stacked([(kinds[0], _expert_rows(gate, e, inter)), (kinds[1], _expert_rows(up, e, inter))])
               for e in range(experts)]
    down_proj = [stacked([(kinds[2], _expert_rows(down, e, hidden))]) for e in range(experts)]
    return QuantizedExperts(gate_up, down_proj)


def _kept(names: Container[str], layer: int, parts: tuple[str, ...]) -> bool:
    """Whether layer `layer`'s projection of `parts` loads from the GGUF's blocks: every part
    there, and none biased (Qwen2's q/k/v: float, with their biases); a model that stores it
    another way (Phi-3's fused attn_qkv) keeps the float conversion's."""
    return all(f"blk.{layer}.{p}.weight" in names and f"blk.{layer}.{p}.bias" not in names
               for p in parts)


def kept_bytes(path: Path) -> tuple[int, int]:
    """(weights, bytes) of the decoder projections and routed experts `--quantization gguf` keeps
    in their own format, as the loaded modules hold them (float32 scales and mins per group)."""
    from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear
    from batchrun.models.quant.int4_linear import Int4WeightLinear

    meta, tensors, _ = read_header(path)
    shapes = {name: (dims, kind) for name, dims, kind, _ in tensors}
    layers = {int(name.split(".")[1]) for name in shapes if name.startswith("blk.")}
    count = total = 0
    for i in sorted(layers):
        groups = [parts for parts in _GGUF_PARTS if _kept(shapes, i, parts)]
        if _kept(shapes, i, _EXPERT_PARTS):
            groups.append(_EXPERT_PARTS)
        for part in (p for parts in groups for p in parts):
            dims, kind = shapes[f"blk.{i}.{part}.weight"]
            if not blocks.supported(kind):
                continue
            cols, rows = dims[0], int(np.prod(dims[1:]))
            count += rows * cols
            if kind in blocks.INT4:
                total += Int4WeightLinear.nbytes(rows, cols)
            else:
                total += GroupedInt8Linear.nbytes(rows, cols, 16 if kind == blocks.Q6_K else 32,
                                                  kind == blocks.Q5_K)
    return count, total


@torch.no_grad()
def load_linears(model: torch.nn.Module, path: Path, how: Method) -> set[str]:
    """Put `how`'s layers built from the GGUF's tensors in place of every decoder layer's
    projections of `model` (and, under `gguf`, its routed experts: quant/experts.py); returns the
    checkpoint tensor names they stand for (which the float weights' loading then skips)."""
    gguf = GgufLinears(path)
    covered: set[str] = set()
    decoder = as_decoder(model)
    for i, layer in enumerate(decoder.layers):
        for projection in decoder.layout.projections:
            parts = projection.gguf
            path_in_layer, _, fused = projection.name.rpartition(".")
            parent = layer.get_submodule(path_in_layer)
            if not parts or not isinstance(getattr(parent, fused, None), nn.Linear) \
                    or not _kept(gguf, i, parts):
                continue  # an MoE block's MLP (its experts below), or float: see _kept
            names = [f"blk.{i}.{p}.weight" for p in parts]
            kinds = [gguf.kind(n) for n in names]
            if how.keeps_gguf(kinds):
                module = own_format(gguf, names, parts)
            else:
                weight = torch.cat([gguf.float_weight(n, p) for n, p in zip(names, parts)])
                module = how.linear_class()(weight, None)
            setattr(parent, fused, module)
            covered.update(f"model.layers.{i}.{p}.weight" for p in projection.parts)
        experts = getattr(layer.mlp, "experts", None)
        if how.needs_gguf and experts is not None and getattr(experts, "per_expert_swiglu", False) \
                and _kept(gguf, i, _EXPERT_PARTS):
            layer.mlp.experts = own_format_experts(gguf, i, experts.num_experts)
            base = f"model.layers.{i}.mlp.experts"  # the float conversion's names, per expert or fused
            covered.update({f"{base}.gate_up_proj", f"{base}.down_proj"} | {
                f"{base}.{e}.{p}.weight" for e in range(experts.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")})
    return covered
