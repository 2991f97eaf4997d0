"""What quant/ reads of a native decoder (models/arch/'s LlamaModel and the families built on
it), as Protocols. quant/ cannot import arch/ (arch's linears become quant's modules through
replace_linears, so the import would run both ways); the calibration, SmoothQuant, the int8
gate and GGUF loading name a model `as_decoder(model)` once and read it through these, and a
quantized linear `as_stored(layer)`."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, cast

import torch
from torch import nn

from batchrun.models.layers.projections import LayerLayout


class Attention(Protocol):
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def qkv_proj(self) -> nn.Module: ...
    @property
    def o_proj(self) -> nn.Module: ...


class Layer(Protocol):
    @property
    def self_attn(self) -> Attention: ...
    @property
    def mlp(self) -> nn.Module: ...
    @property
    def input_layernorm(self) -> nn.Module: ...
    @property
    def post_attention_layernorm(self) -> nn.Module: ...

    def get_submodule(self, target: str) -> nn.Module: ...


class Decoder(Protocol):
    @property
    def embed_tokens(self) -> nn.Embedding: ...
    @property
    def layers(self) -> Sequence[Layer]: ...
    lm_head: nn.Module | None
    num_labels: int
    layout: LayerLayout  # its linears' names (models/layers/projections.py)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def get_submodule(self, target: str) -> nn.Module: ...


class StoredLayer(Protocol):
    """A linear held in a reduced-precision format (quant/'s modules): its shape, bias and
    the float weights it computes with."""

    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def bias(self) -> torch.Tensor | None: ...

    def dequantized_weight(self) -> torch.Tensor: ...


def as_stored(layer: nn.Module) -> StoredLayer:
    """`layer`, one of quant/'s linear modules, read through the StoredLayer Protocol."""
    return cast(StoredLayer, layer)


def as_decoder(model: nn.Module) -> Decoder:
    """`model`, a native decoder, read through the Decoder Protocol (no copy, no check)."""
    return cast(Decoder, model)
