"""Native StableLM (StableLM-3B-4E1T, StableLM 2) built from llama.py's pieces: the one file a
new architecture needs beside its LayerLayout, a line in native.NATIVE_MODULES and a tiny
checkpoint in tests/tiny_models.py.

What differs from Llama: LayerNorm with a bias in place of RMSNorm, rotary embedding on the
first partial_rotary_factor of each head (rope.py), head_dim always hidden / heads. Optional:
q/k/v biases (use_qkv_bias), a LayerNorm per head on q and k (qk_layernorm, no bias), and the
parallel residual (use_parallel_residual: attention and MLP both read the input norm and add to
the stream together, there is no post-attention norm). Checkpoint names are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.attention import AttentionMetadata, paged_attention
from batchrun.models.arch import llama
from batchrun.models.config import model_config
from batchrun.models.layers.projections import LLAMA, LayerLayout
from batchrun.models.layers.rope import RotaryEmbedding, StepRope

SUPPORTED_ARCHITECTURES = {"StableLmForCausalLM"}


@dataclass(frozen=True)
class ModelConfig(model_config.ModelConfig):
    qk_layernorm: bool = False
    parallel_residual: bool = False

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "StableLmForCausalLM")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {hf.hidden_act!r} (SwiGLU/silu only)")
        fields = model_config.shape_fields(hf, eps="layer_norm_eps")  # the LayerNorms' eps
        fields["head_dim"] = hf.hidden_size // hf.num_attention_heads  # config.head_dim unread
        return cls(**fields, qkv_bias=bool(getattr(hf, "use_qkv_bias", False)), qk_norm=False,
                   qk_layernorm=bool(getattr(hf, "qk_layernorm", False)),
                   parallel_residual=bool(getattr(hf, "use_parallel_residual", False)))


class LayerNorm(llama.RMSNorm):
    """nn.LayerNorm (weight and bias) behind RMSNorm's interface, so llama's decoder loop and
    its residual stream (float32 under the CPU kernels) run it unchanged."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        """The norm of x (computed in x's dtype), in the norm's dtype."""
        return F.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.bias.to(x.dtype),
                            self.eps).to(self.weight.dtype)

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor,
                    cpu_kernels) -> torch.Tensor:
        if x is not None:
            residual.add_(x)
        return self.forward(residual)


class HeadNorms(nn.Module):
    """A LayerNorm without bias for each head (transformers' StableLmLayerNormPerHead: its
    `norms.<head>.weight` names), over [T, heads, head_dim]."""

    def __init__(self, head_dim: int, heads: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim, eps=eps, bias=False)
                                   for _ in range(heads))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([cast(nn.LayerNorm, n).weight for n in self.norms]).to(x.dtype)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * weight


class Attention(llama.Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.q_layernorm: HeadNorms | None = None
        self.k_layernorm: HeadNorms | None = None
        if cfg.qk_layernorm:
            self.q_layernorm = HeadNorms(cfg.head_dim, cfg.num_heads, cfg.rms_norm_eps)
            self.k_layernorm = HeadNorms(cfg.head_dim, cfg.num_kv_heads, cfg.rms_norm_eps)

    def forward(self, x, rope: StepRope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        if self.q_layernorm is None or self.k_layernorm is None:
            return super().forward(x, rope, kv, meta)  # partial or fused RoPE there
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_layernorm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_layernorm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.rotate(q, *rope.cos_sin), RotaryEmbedding.rotate(k, *rope.cos_sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        nn.Module.__init__(self)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.parallel = cfg.parallel_residual
        if not self.parallel:  # transformers has none either: no weight of that name to load
            self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h, residual, rope: StepRope, kv, meta) -> torch.Tensor:
        if not self.parallel:
            return super().forward(h, residual, rope, kv, meta)
        attn = self.self_attn(h, rope, kv, meta)
        out = self.mlp(h, rope.kernels)
        residual.add_(attn)  # stream + attn, then the next norm adds the MLP: transformers' order
        return out


class StableLmModel(llama.LlamaModel):
    layer_class = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_layout(self, cfg: model_config.ModelConfig) -> LayerLayout:
        """Llama's names. With the parallel residual q/k/v and the MLP read one norm, which
        cannot fold both projections' SmoothQuant factors (either's would reach the other):
        both smooth inside their linears."""
        if cast(ModelConfig, cfg).parallel_residual:
            return LLAMA.with_norm("self_attn.qkv_proj", None).with_norm("mlp.gate_up_proj", None)
        return LLAMA


Model = StableLmModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", params.get("type")) == "dynamic":
        return "dynamic NTK RoPE scaling"
    if hf.hidden_size % hf.num_attention_heads:
        return "hidden_size not a multiple of num_attention_heads"
    return llama.unsupported(hf)
