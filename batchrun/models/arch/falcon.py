"""Native Falcon (Falcon-7B/40B/180B, Falcon 2 "new decoder architecture") on llama.py's
decoder loop, with RoPE.

Three layer shapes, all from the config: sequential (input norm, attention, post-attention
norm, MLP: not parallel_attn); parallel attention and MLP reading one norm (parallel_attn, or
the new decoder architecture with num_ln_in_parallel_attn 1); parallel with a norm each
(ln_attn, ln_mlp: the new decoder architecture's default). q/k/v are one linear: in the new
decoder architecture and multi-query checkpoints its rows are per K/V group [its query heads,
key, value] (multi-query: one group), else per head [q, k, v] (BLOOM's). LayerNorms with
biases, a GELU MLP, optional biases on every linear (config.bias), a tied head. ALiBi Falcon is
refused (unsupported): transformers' eager attention adds the bias twice where its SDPA path
adds it once, so there is no one reference to be exact to; the backend runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.attention import AttentionMetadata, paged_attention
from batchrun.models.arch import llama
from batchrun.models.arch.bloom import rename
from batchrun.models.arch.stablelm import LayerNorm
from batchrun.models.config import model_config
from batchrun.models.layers.projections import FALCON, LayerLayout
from batchrun.models.layers.rope import RotaryEmbedding, StepRope

SUPPORTED_ARCHITECTURES = {"FalconForCausalLM"}
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # F.gelu's approximate


@dataclass(frozen=True)
class ModelConfig(model_config.ModelConfig):
    grouped_qkv: bool = False  # q/k/v rows per K/V group [queries..., k, v]; else per head
    parallel: bool = True  # attention and MLP side by side, added to the stream together
    norms_per_layer: int = 1  # parallel: one norm both read, or ln_attn and ln_mlp
    bias: bool = False
    gelu: str = "none"

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "FalconForCausalLM")
        heads, new = hf.num_attention_heads, bool(hf.new_decoder_architecture)
        if hf.hidden_size % heads:
            raise ValueError("hidden_size not a multiple of num_attention_heads")
        if getattr(hf, "activation", "gelu") not in _GELU:
            raise ValueError(f"unsupported activation {hf.activation!r} (GELU only)")
        kv = hf.num_kv_heads if new else 1 if hf.multi_query else heads
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=getattr(hf, "ffn_hidden_size", None) or 4 * hf.hidden_size,
                   num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=kv,
                   head_dim=hf.hidden_size // heads, rms_norm_eps=hf.layer_norm_epsilon,
                   max_position_embeddings=hf.max_position_embeddings,
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
                   hf_config=hf, qkv_bias=bool(hf.bias), qk_norm=False,
                   grouped_qkv=new or bool(hf.multi_query), parallel=new or bool(hf.parallel_attn),
                   norms_per_layer=2 if new and hf.num_ln_in_parallel_attn in (None, 2) else 1,
                   bias=bool(hf.bias), gelu=_GELU[getattr(hf, "activation", "gelu")])


class Attention(llama.Attention):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # none of llama's projections: Falcon's own below
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, \
            cfg.head_dim
        self.grouped = cfg.grouped_qkv
        rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, rows, bias=cfg.bias)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.scale = cfg.head_dim ** -0.5
        self.window = self.softcap = self.sinks = None

    def forward(self, x: torch.Tensor, rope: StepRope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        fused = self.query_key_value(x)
        if self.grouped:
            g = fused.view(-1, self.num_kv_heads, self.num_heads // self.num_kv_heads + 2,
                           self.head_dim)
            q, k, v = g[:, :, :-2].flatten(1, 2), g[:, :, -2], g[:, :, -1]
        else:
            q, k, v = fused.view(-1, self.num_heads, 3, self.head_dim).unbind(2)
        q, k = RotaryEmbedding.rotate(q, *rope.cos_sin), RotaryEmbedding.rotate(k, *rope.cos_sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.dense(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.bias)
        self.dense_4h_to_h = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)
        self.gelu = cfg.gelu

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.gelu))


class StreamOnly(nn.Module):
    """The input "norm" of a layer with two norms (ln_attn, ln_mlp, which the layer applies):
    adds to the stream and hands the stream itself on."""

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor,
                    cpu_kernels) -> torch.Tensor:
        if x is not None:
            residual.add_(x)
        return residual


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        nn.Module.__init__(self)
        norm = lambda: LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.parallel, self.two_norms = cfg.parallel, cfg.norms_per_layer == 2
        if self.two_norms:
            self.input_layernorm = StreamOnly()  # type: ignore[assignment]
            self.ln_attn, self.ln_mlp = norm(), norm()
        else:
            self.input_layernorm = norm()
        if not self.parallel:
            self.post_attention_layernorm = norm()
        self.self_attn = Attention(cfg)
        self.mlp = mlp

    def forward(self, h, residual, rope: StepRope, kv, meta) -> torch.Tensor:
        """h: this layer's input norm's output (with two norms: the stream itself), residual
        the stream; returns what the next norm adds to the stream."""
        if not self.parallel:
            attn = self.self_attn(h, rope, kv, meta)
            return self.mlp(self.post_attention_layernorm.add_forward(attn, residual, None))
        h_mlp = h
        if self.two_norms:
            h, h_mlp = self.ln_attn(h), self.ln_mlp(h)
        out = self.mlp(h_mlp)
        return out.add_(self.self_attn(h, rope, kv, meta))  # transformers' order: mlp += attn


class FalconModel(llama.LlamaModel):
    layer_class = DecoderLayer
    layers_path = "transformer.h"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_layout(self, cfg: model_config.ModelConfig) -> LayerLayout:
        """Falcon's names; the norm each projection's input comes out of, where it may fold
        SmoothQuant's factors into it: not a norm both attention and MLP read."""
        assert isinstance(cfg, ModelConfig)
        if not cfg.parallel:
            return FALCON
        if cfg.norms_per_layer == 2:
            return FALCON.with_norm("self_attn.query_key_value", "ln_attn") \
                .with_norm("mlp.dense_h_to_4h", "ln_mlp")
        return FALCON.with_norm("self_attn.query_key_value", None) \
            .with_norm("mlp.dense_h_to_4h", None)

    def make_mlp(self, cfg: model_config.ModelConfig, layer: int) -> nn.Module:
        assert isinstance(cfg, ModelConfig)
        return MLP(cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((rename(name), tensor) for name, tensor in weights)


Model = FalconModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    if getattr(hf, "alibi", False):
        return ("ALiBi Falcon (transformers' eager attention adds the bias twice, its SDPA "
                "attention once)")
    if hf.new_decoder_architecture and not hf.parallel_attn:
        return "the new decoder architecture without parallel attention"
    if not hf.new_decoder_architecture and not hf.multi_query and \
            hf.num_kv_heads != hf.num_attention_heads:
        return "num_kv_heads other than num_attention_heads without multi-query or the new " \
               "decoder architecture"
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", params.get("type")) == "dynamic":
        return "dynamic NTK RoPE scaling"
    return None
