"""Native BLOOM on llama.py's decoder loop.

What differs from Llama: no position embedding but ALiBi (each head's score of a key gains
slope * its distance back from the query: layers/alibi.py, added inside the attention kernels);
LayerNorms with biases, one more after the word embeddings; q/k/v fused in one linear with a
bias whose rows are per head [q, k, v] (BLOOM's interleaved layout, kept as the checkpoint
holds it: LoRA and SmoothQuant see `query_key_value` whole); a GELU (tanh) MLP of 4 x hidden
with biases; every linear has a bias; the LM head tied to the embeddings. Checkpoint names are
BLOOM's (`transformer.h.<i>.self_attention.query_key_value`, ...), renamed to llama's model
attributes at load.
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
from batchrun.models.layers.alibi import NoRope, StepAlibi, alibi_slopes
from batchrun.models.layers.projections import BLOOM, LayerLayout

SUPPORTED_ARCHITECTURES = {"BloomForCausalLM"}
# checkpoint prefix -> ours, after "transformer." is dropped (base-model checkpoints lack it); a
# layer's self_attention is our self_attn (what the calibration and the engine read)
_RENAMES = (("word_embeddings_layernorm.", "embed_layernorm."),
            ("word_embeddings.", "embed_tokens."), ("h.", "layers."), ("ln_f.", "norm."))


@dataclass(frozen=True)
class ModelConfig(model_config.ModelConfig):
    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "BloomForCausalLM")
        heads = hf.num_attention_heads
        if hf.hidden_size % heads:
            raise ValueError("hidden_size not a multiple of num_attention_heads")
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=4 * hf.hidden_size, num_layers=hf.num_hidden_layers,
                   num_heads=heads, num_kv_heads=heads, head_dim=hf.hidden_size // heads,
                   rms_norm_eps=hf.layer_norm_epsilon,
                   # ALiBi has no table to outgrow; the backend's default length where unset
                   max_position_embeddings=getattr(hf, "max_position_embeddings", None) or 2048,
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
                   qkv_bias=True, qk_norm=False, hf_config=hf)


class Attention(llama.Attention):
    """q/k/v from one linear as [heads, (q, k, v), head_dim] rows, attended with ALiBi."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # none of llama's projections: BLOOM's own below
        self.num_heads = self.num_kv_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.window = self.softcap = self.sinks = None
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, step, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """step: the StepAlibi of BloomModel.step_rope."""
        fused = self.query_key_value(x).view(-1, self.num_heads, 3, self.head_dim)
        q, k, v = fused.unbind(2)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, alibi=step.slopes)
        return self.dense(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.dense_4h_to_h = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        # BLOOM's gelu is the tanh form (its 0.79788456 is sqrt(2 / pi) to float32's precision)
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class BloomBlock(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        nn.Module.__init__(self)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h, residual, rope, kv, meta) -> torch.Tensor:
        """h: this layer's normed input, residual: the stream (updated in place); returns the
        MLP's output, which the next norm adds to the stream."""
        attn = self.self_attn(h, rope, kv, meta)
        return self.mlp(self.post_attention_layernorm.add_forward(attn, residual, rope.kernels))


class BloomModel(llama.LlamaModel):
    layer_class = BloomBlock
    rope_class = NoRope
    layers_path = "transformer.h"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._slopes: dict[torch.device, torch.Tensor] = {}

    def make_layout(self, cfg: model_config.ModelConfig) -> LayerLayout:
        return BLOOM

    def make_mlp(self, cfg: model_config.ModelConfig, layer: int) -> nn.Module:
        assert isinstance(cfg, ModelConfig)
        return MLP(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_layernorm(self.embed_tokens(input_ids))

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """The layers' positional input: ALiBi's slopes on the step's device (made once)."""
        device = positions.device
        if device not in self._slopes:
            self._slopes[device] = alibi_slopes(self.config.num_heads, device)
        return StepAlibi(self._slopes[device], self.cpu_kernels)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((rename(name), tensor) for name, tensor in weights)


def rename(name: str) -> str:
    """A BLOOM or Falcon checkpoint name as our model's."""
    return checkpoint_name(name, "transformer.", ((".self_attention.", ".self_attn."),), _RENAMES)


Model = BloomModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    if getattr(hf, "apply_residual_connection_post_layernorm", False):
        return "the residual taken after the input LayerNorm " \
               "(apply_residual_connection_post_layernorm)"
    if getattr(hf, "pretraining_tp", 1) > 1 and getattr(hf, "slow_but_exact", False):
        return "slow_but_exact (the output projections summed in pretraining_tp slices)"
    return None
