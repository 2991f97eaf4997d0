"""The names a native decoder layer's linears go by, declared once per architecture: which
checkpoint projections each of our (fused) linears stacks, the norm whose output it reads, and
llama.cpp's names for its parts. Weight loading (arch/llama.py), SmoothQuant's targets
(quant/smoothquant.py), LoRA targeting (LlamaModel.lora_targets), the footprint (through those
targets) and GGUF reading (quant/gguf.py) all read the declaration, so a new architecture that
names its projections otherwise declares a LayerLayout and nothing else changes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Projection:
    """One linear of a decoder layer, `name` its path in the layer ("self_attn.qkv_proj"), holding
    the checkpoint's `parts` stacked along its output rows in that order. `split` says how its
    rows divide among them: "qkv" as query, key and value heads; "even" in equal shares. `norm`:
    the layer's norm whose output it reads (SmoothQuant folds its smoothing factors there), or
    None; `gguf`: llama.cpp's tensor names of the parts (empty: not read from a GGUF's blocks)."""

    name: str
    parts: tuple[str, ...]
    norm: str | None = None
    gguf: tuple[str, ...] = ()
    split: Literal["qkv", "even"] = "even"

    def rows(self, total: int, num_heads: int, num_kv_heads: int,
             head_dim: int) -> list[tuple[int, int]]:
        """(start, length) of each part's rows in a linear of `total` output rows."""
        if self.split == "qkv" and len(self.parts) == 3:
            q, kv = num_heads * head_dim, num_kv_heads * head_dim
            return [(0, q), (q, kv), (q + kv, kv)]
        share = total // len(self.parts)
        return [(i * share, share) for i in range(len(self.parts))]


@dataclass(frozen=True)
class LayerLayout:
    """A decoder layer's projections, in the order they are computed."""

    projections: tuple[Projection, ...]

    def stacked(self) -> dict[str, tuple[Projection, int]]:
        """A checkpoint module's own name ("q_proj") -> (the projection that stacks it, its
        index there), for the parts stored apart (a part named as its projection loads as it
        is). By the module's own name: the same stacking applies wherever it sits (an MoE's
        shared expert's gate_proj/up_proj go into its gate_up_proj)."""
        return {part.rsplit(".", 1)[-1]: (p, i) for p in self.projections
                for i, part in enumerate(p.parts) if part != p.name}

    def with_norm(self, projection: str, norm: str | None) -> LayerLayout:
        """The layout with `projection` reading `norm`'s output (None: a norm it may not fold
        into, one another projection already reads)."""
        return LayerLayout(tuple(replace(p, norm=norm) if p.name == projection else p
                                 for p in self.projections))


# Llama and the families built on it (Mistral, Qwen2/3, Granite, ...): q/k/v and gate/up fused.
LLAMA = LayerLayout((
    Projection("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "input_layernorm", ("attn_q", "attn_k", "attn_v"), split="qkv"),
    Projection("self_attn.o_proj", ("self_attn.o_proj",), None, ("attn_output",)),
    Projection("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm",
               ("ffn_gate", "ffn_up")),
    Projection("mlp.down_proj", ("mlp.down_proj",), None, ("ffn_down",)),
))

# Phi-3's checkpoints store q/k/v and gate/up fused as we hold them (PEFT targets them whole).
PHI3 = LayerLayout((
    Projection("self_attn.qkv_proj", ("self_attn.qkv_proj",), "input_layernorm"),
    Projection("self_attn.o_proj", ("self_attn.o_proj",)),
    Projection("mlp.gate_up_proj", ("mlp.gate_up_proj",), "post_attention_layernorm"),
    Projection("mlp.down_proj", ("mlp.down_proj",)),
))
