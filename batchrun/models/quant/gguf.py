"""A GGUF checkpoint's linear layers loaded in their own format, never the whole model in float.

- Q4_1 blocks (32 weights: fp16 d and m, 16 bytes of nibbles, w = d * q + m) are int4-weight's
  groups as they are: exact.
- Q4_0 blocks (w = d * (q - 8)) are the same with m = -8 d: exact.
- Q8_0 blocks (w = d * q, int8 q, 32 per fp16 d) and every other type go to the layer's method
  one layer at a time through the gguf package's dequantisation, then quantized as a float
  layer is (Q8_0 into per-channel int8: a requantisation, not exact).

The q/k rows are un-permuted as gguf_weights.py does for the float conversion, and q/k/v (and
gate/up) are stacked into the model's fused projections.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batchrun.models.gguf_weights import read_header, unpermute
from batchrun.models.loader import GGUF_SOURCE as SOURCE_FILE  # the .gguf a converted folder came from

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values
_BLOCK = 32
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
_FUSED = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
          "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}


def source_of(folder: Path) -> Path | None:
    """The .gguf a converted model folder came from, when it still exists."""
    f = Path(folder) / SOURCE_FILE
    if not f.is_file():
        return None
    source = Path(f.read_text().strip())
    return source if source.is_file() else None


def q4_groups(raw: np.ndarray, kind: int, rows: int, cols: int):
    """(q uint8 [rows, cols] in 0..15, scale float32 [rows, cols/32], min float32 [rows, cols/32])
    of Q4_0 or Q4_1 blocks."""
    blocks = raw.reshape(rows, cols // _BLOCK, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8 * d
        qs = blocks[..., 2:]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1)  # byte j: weights j (low) and j + 16 (high)
    return q.reshape(rows, cols), d, m


class GgufLinears:
    """The linear tensors of a llama GGUF file, read one at a time."""

    def __init__(self, path: Path):
        self.meta, tensors, self.start = read_header(path)
        self.tensors = {name: (dims, kind, offset) for name, dims, kind, offset in tensors}
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

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
        p = "llama.attention."
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

    def q4_weight(self, name: str, part: str):
        raw, rows, cols = self.raw(name)
        q, d, m = q4_groups(raw, self.kind(name), rows, cols)
        heads = self._heads(part)
        if heads:
            q, d, m = (unpermute(a, heads) for a in (q, d, m))
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m))


@torch.no_grad()
def load_linears(model: torch.nn.Module, path: Path, method: str) -> set[str]:
    """Put `method`'s layers built from the GGUF's tensors in place of every decoder layer's
    projections of `model`; returns the checkpoint tensor names they stand for (which the float
    weights' loading then skips)."""
    from batchrun.models.quant import linear_class
    from batchrun.models.quant.int4_linear import Int4WeightLinear

    gguf = GgufLinears(path)
    covered: set[str] = set()
    hf_parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i, layer in enumerate(model.layers):
        for fused, parts in _FUSED.items():
            parent = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
            if getattr(parent, fused).bias is not None:
                continue  # biased projections (Qwen2) load as float weights
            names = [f"blk.{i}.{p}.weight" for p in parts]
            if method == "int4-weight" and all(gguf.kind(n) in (Q4_0, Q4_1) for n in names):
                q, d, m = (torch.cat(t) for t in zip(*(gguf.q4_weight(n, p) for n, p in zip(names, parts))))
                module = Int4WeightLinear(None, None, q=q, scale=d, minimum=m)
            else:
                weight = torch.cat([gguf.float_weight(n, p) for n, p in zip(names, parts)])
                module = linear_class(method)(weight, None)
            setattr(parent, fused, module)
            covered.update(f"model.layers.{i}.{hf_parts[p]}.weight" for p in parts)
    return covered
