"""Native Gemma, Gemma 2 and Gemma 3 (text) decoders, built from llama.py's pieces.

What differs from Llama: a GeGLU MLP (GELU, tanh approximation), RMSNorm scaling by (1 + w)
(folded into the weights at load, so llama's norm and its fused CPU kernel run unchanged),
embeddings scaled by sqrt(hidden). Gemma 2 and 3 add norms after attention and after the MLP,
an attention scale from query_pre_attn_scalar, sliding-window layers alternating with global
ones (layer_types); Gemma 2 soft-caps attention scores and the final logits; Gemma 3 has q/k
norms and a RoPE of its own for the sliding layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, cast

import torch
from torch import nn

from batchrun.engine.kernels import fallback_ops
from batchrun.models.arch import llama

from batchrun.models.config import model_config
from batchrun.models.arch.llama import Attention, MLP, RMSNorm
from batchrun.models.layers.rope import RotaryEmbedding, StepRope, longrope_reason
from batchrun.models.layers.projections import LayerLayout

SUPPORTED_ARCHITECTURES = {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"}
GELU_TANH = {"gelu_pytorch_tanh", "gelu_tanh"}


@dataclass(frozen=True)
class ModelConfig(model_config.ModelConfig):
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and one on each MLP side
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "GemmaForCausalLM")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
        if act not in GELU_TANH:
            raise ValueError(f"unsupported activation {act!r} (GeGLU with tanh-approximated "
                             f"GELU only)")
        if getattr(hf, "attention_bias", False):
            raise ValueError("attention_bias (Gemma checkpoints have none)")
        later = hf.model_type != "gemma"
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        fields = model_config.shape_fields(hf)
        return cls(**fields, qkv_bias=False, qk_norm=hf.model_type == "gemma3_text",
                   sandwich_norms=later,
                   attn_scale=scalar ** -0.5 if later and scalar else None,
                   attn_softcap=getattr(hf, "attn_logit_softcapping", None) or None,
                   final_softcap=getattr(hf, "final_logit_softcapping", None) or None,
                   layer_types=tuple(getattr(hf, "layer_types", None)
                                     or ["full_attention"] * hf.num_hidden_layers))


class Ropes(nn.Module):
    """One RoPE table per layer type (Gemma 3's sliding layers have their own base)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        params = getattr(cfg.hf_config, "rope_parameters", None) or {}
        self.tables = nn.ModuleDict({
            t: RotaryEmbedding(cfg, t if t in params else None) for t in sorted(set(cfg.layer_types))})


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        nn.Module.__init__(self)
        self.layer_type = cfg.layer_types[index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.windows[index], cfg.attn_scale, cfg.attn_softcap)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, ropes: StepRope | dict[str, StepRope], kv, meta) -> torch.Tensor:
        rope = ropes[self.layer_type] if isinstance(ropes, dict) else ropes  # GemmaModel passes a dict
        if not self.sandwich:
            return super().forward(h, residual, rope, kv, meta)
        attn = self.post_attention_layernorm(self.self_attn(h, rope, kv, meta), rope.kernels)
        h = self.pre_feedforward_layernorm.add_forward(attn, residual, rope.kernels)
        return self.post_feedforward_layernorm(self.mlp(h, rope.kernels), rope.kernels)


class GemmaModel(llama.LlamaModel):
    layer_class = DecoderLayer
    rope_class = Ropes

    def make_layout(self, cfg: model_config.ModelConfig) -> LayerLayout:
        """Gemma 2/3's MLP reads the pre-feedforward norm (their sandwich norms)."""
        layout = super().make_layout(cfg)
        if cast(ModelConfig, cfg).sandwich_norms:
            return layout.with_norm("mlp.gate_up_proj", "pre_feedforward_layernorm")
        return layout

    def make_mlp(self, cfg: model_config.ModelConfig, layer: int) -> nn.Module:
        return MLP(cfg, activation="gelu_tanh")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # a new tensor: scaled in place
        return x.mul_(torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype))

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, StepRope]:
        tables = cast(Ropes, self.rope).tables
        return {t: StepRope(positions, cast(RotaryEmbedding, table), dtype, self.cpu_kernels)
                for t, table in tables.items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # float32, a new tensor: capped in place
        cap = cast(ModelConfig, self.config).final_softcap
        if cap is None:
            return logits
        return fallback_ops.softcap_(logits, cap, self.cpu_kernels)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for module in self.modules():  # Gemma's norms scale by (1 + w)
            if isinstance(module, RMSNorm):
                module.weight.add_(1)


Model = GemmaModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    if getattr(hf, "use_bidirectional_attention", False):
        return "bidirectional attention"
    reason = llama.unsupported(hf)
    if reason:
        return reason
    params = getattr(hf, "rope_parameters", None) or {}
    for layer_type in sorted(set(getattr(hf, "layer_types", None) or ()) & set(params)):
        reason = longrope_reason(hf, layer_type)
        if reason:
            return reason
    return None
