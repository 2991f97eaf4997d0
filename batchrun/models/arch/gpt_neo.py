"""Native GPT-Neo on llama.py's decoder loop.

What differs from Llama: learned absolute position embeddings added to the token embeddings
(no RoPE); LayerNorms with biases; q/k/v without bias (fused here as Llama's), the output
projection with one; attention scores not scaled (scale 1); "local" layers attend to their last
window_size positions (a sliding window: the engine's windowed KV groups), "global" layers to
the whole context; a GELU (tanh) MLP of c_fc / c_proj with biases; the LM head tied.
Checkpoint names (`transformer.h.<i>.attn.attention.q_proj`, ln_1, wte, wpe, ...) are renamed
to llama's attributes at load; LoRA sees the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.attention import AttentionMetadata, paged_attention
from batchrun.models.arch import llama
from batchrun.models.arch.native import checkpoint_name
from batchrun.models.arch.stablelm import LayerNorm
from batchrun.models.config import model_config
from batchrun.models.layers.alibi import NoRope
from batchrun.models.layers.projections import GPT_NEO, LayerLayout

SUPPORTED_ARCHITECTURES = {"GPTNeoForCausalLM"}
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # F.gelu's approximate
# checkpoint names -> ours, after "transformer." is dropped
_PREFIXES = (("wte.", "embed_tokens."), ("wpe.", "embed_positions."), ("h.", "layers."),
             ("ln_f.", "norm."))
_INNER = ((".attn.attention.", ".self_attn."), (".ln_1.", ".input_layernorm."),
          (".ln_2.", ".post_attention_layernorm."))


@dataclass(frozen=True)
class ModelConfig(model_config.ModelConfig):
    gelu: str = "tanh"

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "GPTNeoForCausalLM")
        heads = hf.num_attention_heads
        if hf.hidden_size % heads:
            raise ValueError("hidden_size not a multiple of num_attention_heads")
        if hf.activation_function not in _GELU:
            raise ValueError(f"unsupported activation {hf.activation_function!r} (GELU only)")
        local = hf.window_size if hf.window_size < hf.max_position_embeddings else None
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size or 4 * hf.hidden_size,
                   num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
                   head_dim=hf.hidden_size // heads, rms_norm_eps=hf.layer_norm_epsilon,
                   max_position_embeddings=hf.max_position_embeddings,
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
                   qkv_bias=False, qk_norm=False, hf_config=hf,
                   windows=tuple(local if t == "local" else None for t in hf.attention_layers),
                   gelu=_GELU[hf.activation_function])


@dataclass
class NoPositions:
    """What the layers take for a step's positions: nothing but the CPU kernels (the positions
    went in with the embeddings)."""

    kernels: object | None = None


class Attention(llama.Attention):
    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__(cfg, window, scale=1.0)  # GPT-Neo does not scale its scores
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=True)

    def forward(self, x, rope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = paged_attention(q.view(-1, self.num_heads, self.head_dim),
                              k.view(-1, self.num_kv_heads, self.head_dim),
                              v.view(-1, self.num_kv_heads, self.head_dim), kv[0], kv[1], meta,
                              self.scale, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.gelu = cfg.gelu

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.gelu))


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        nn.Module.__init__(self)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.windows[index])
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp


class GPTNeoModel(llama.LlamaModel):
    layer_class = DecoderLayer
    rope_class = NoRope
    layers_path = "transformer.h"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_layout(self, cfg: model_config.ModelConfig) -> LayerLayout:
        return GPT_NEO

    def make_mlp(self, cfg: model_config.ModelConfig, layer: int) -> nn.Module:
        assert isinstance(cfg, ModelConfig)
        return MLP(cfg)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return NoPositions(self.cpu_kernels)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_our_name(name), tensor) for name, tensor in weights)


def _our_name(name: str) -> str:
    return checkpoint_name(name, "transformer.", _INNER, _PREFIXES)


Model = GPTNeoModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    other = sorted(set(hf.attention_layers) - {"global", "local"})
    return f"{', '.join(other)} attention layers" if other else None
