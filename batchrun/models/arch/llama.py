"""Native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3) on the engine's flat
batch.

One forward pass takes every token scheduled in a step as a single row ([T] ids and positions);
attention reads and writes the paged KV cache through the metadata the runner built. Llama,
Mistral (sliding window), Qwen2 (QKV bias, sliding layers), Qwen3 (q/k RMSNorm) and Phi-3
(checkpoints with q/k/v and gate/up already fused, partial rotary, LongRoPE) differ only in
config flags. gemma.py builds on these pieces.
"""

from __future__ import annotations

from typing import Iterable, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.attention import AttentionMetadata, layer_metadata, paged_attention
from batchrun.engine.kernels import fallback_ops
from batchrun.models.config.model_config import ModelConfig
from batchrun.models.config.model_config import SUPPORTED_ARCHITECTURES  # noqa: F401 (native.py reads it here)
from batchrun.models.layers.projections import LLAMA, PHI3, LayerLayout
from batchrun.models.layers.rope import RotaryEmbedding, StepRope, longrope_reason
from batchrun.models.weights.tensor_copy import copy_into

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        """The norm of x; by the CPU kernels when given (in place, in the norm's dtype)."""
        return fallback_ops.rms_norm(x, self.weight, self.eps, cpu_kernels)

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor, cpu_kernels) -> torch.Tensor:
        """residual += x in place (x None: nothing added), and the norm of the sum, in the norm's
        dtype (with the CPU kernels one pass, the residual stream float32 either way)."""
        return fallback_ops.add_rms_norm(x, residual, self.weight, self.eps, cpu_kernels)


class Attention(nn.Module):
    """window: the layer's sliding window; scale (default head_dim**-0.5) and softcap: of the
    attention scores."""

    def __init__(self, cfg: ModelConfig, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.norm_across_heads = cfg.qk_norm_across_heads
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            across = cfg.qk_norm_across_heads
            self.q_norm = RMSNorm(self.q_size if across else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if across else cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = scale or cfg.head_dim ** -0.5
        self.window, self.softcap = window, softcap
        self.sinks: torch.Tensor | None = None  # [heads] attention sinks (models/arch/gpt_oss.py)

    def forward(self, x, rope: StepRope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        kernels = rope.kernels if self.q_norm is None and rope.table.rotary_dim == self.head_dim \
            else None
        fused = kernels is not None
        if kernels is not None:  # rotate the q and k heads in place, in one pass
            kernels.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim,
                               rope.positions, rope.table.cos, rope.table.sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_across_heads:
            assert self.q_norm is not None and self.k_norm is not None  # made with qk_norm
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not fused:
            if self.q_norm is not None and self.k_norm is not None and not self.norm_across_heads:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.rotate(q, *rope.cos_sin), RotaryEmbedding.rotate(k, *rope.cos_sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window, self.softcap,
                              self.sinks)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    """down(act(gate) * up) (fallback_ops.gated_mul)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None,
                 activation: str = "silu"):
        super().__init__()
        intermediate = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        return self.down_proj(fallback_ops.gated_mul(self.gate_up_proj(x), self.activation, cpu_kernels))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.windows[index] if cfg.windows else None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp  # forward(x, cpu_kernels): the dense MLP, or an MoE block (models/arch/moe.py)

    def forward(self, h, residual, rope: StepRope, kv, meta) -> torch.Tensor:
        """h is this layer's normed input and residual the stream, updated in place; returns the
        MLP's output, which the next norm adds to the stream."""
        attn = self.self_attn(h, rope, kv, meta)
        return self.mlp(self.post_attention_layernorm.add_forward(attn, residual, rope.kernels),
                        rope.kernels)


class LlamaModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer  # (cfg, index, mlp) -> a decoder layer
    rope_class: type[nn.Module] = RotaryEmbedding  # (cfg) -> the RoPE tables step_rope reads
    layers_path = "model.layers"  # the decoder layers' module name in the checkpoint (LoRA's)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, self.make_mlp(cfg, i))
                                    for i in range(self.decoder_layer_count(cfg)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = self.rope_class(cfg)
        # A sequence classifier has a `score` head in place of the LM head (it generates nothing).
        self.num_labels = cfg.num_labels
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels \
            else None
        self.lm_head = None if cfg.tie_word_embeddings or cfg.num_labels else \
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # The CPU kernels (engine/kernels/ops.py: norms, RoPE, gated activations...), set by the
        # loader when the model runs on the CPU in float32/bfloat16; None = PyTorch ops.
        self.cpu_kernels = None
        self.layout = self.make_layout(cfg)

    def decoder_layer_count(self, cfg: ModelConfig) -> int:
        """The decoder's layers: the KV layers (cfg.num_layers) unless some keep no KV (a
        hybrid's linear-attention layers: models/arch/qwen3_next.py)."""
        return cfg.num_layers

    def make_layout(self, cfg: ModelConfig) -> LayerLayout:
        """How the layers' linears are named (models/layers/projections.py)."""
        return PHI3 if getattr(cfg.hf_config, "model_type", None) == "phi3" else LLAMA

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block (a subclass builds MoE or GeGLU blocks here)."""
        return MLP(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat row of tokens of one step."""
        x = self.embed_at(input_ids, positions)
        rope = self.step_rope(positions, x.dtype)
        metas = [layer_metadata(meta, i) for i in range(len(self.layers))]  # each layer's KV group
        # Each residual add runs inside the norm that follows it (x is the stream, in place).
        # With the CPU kernels the stream is float32 under bfloat16 too (the layers compute in
        # bfloat16): summing the layers' outputs in bfloat16 cost top-1 agreement with float32
        # (benchmarks/quality.py), and the kernel reads and writes either at one pass's cost.
        if self.cpu_kernels is not None:
            x = x.float()
        layers = self.decoder_layers
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        h = layers[0].input_layernorm.add_forward(None, x, self.cpu_kernels)
        for layer, kv, m, norm in zip(layers, kv_caches, metas, norms):
            h = norm.add_forward(layer(h, x, rope, kv, m), x, self.cpu_kernels)
        return h

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """self.layers as what they hold (nn.ModuleList is not generic; layer_class made them)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings (a model with learned positions adds them here)."""
        return self.embed(input_ids)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """What the layers take for the step's rotary embedding."""
        return StepRope(positions, cast(RotaryEmbedding, self.rope), dtype, self.cpu_kernels)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embeddings
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sequence-classification head's logits [N, num_labels] of final hidden states."""
        assert self.score is not None  # asked of a sequence classifier only (num_labels)
        return self.score(hidden).float()

    def lora_targets(self):
        """The PEFT modules of the checkpoint (self.layout's parts) as slices of our fused
        projections; a projection a layer does not have (an MoE layer's MLP) is no target."""
        from batchrun.models.lora.targets import LoraTargets, Target

        targets = {}
        for index, layer in enumerate(self.layers):
            for p in self.layout.projections:
                linear = _submodule(layer, p.name)  # float, packed or quantized
                if linear is None or not hasattr(linear, "in_features"):
                    continue
                rows = self._rows(p, linear.out_features)
                targets.update({(index, part): Target(p.name, start, start + n, linear.in_features)
                                for part, (start, n) in zip(p.parts, rows)})
        return LoraTargets(self.layers_path, self.layers, targets)

    def _rows(self, projection, total: int) -> list[tuple[int, int]]:
        cfg = self.config
        return projection.rows(total, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face checkpoint tensors, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        stacked = self.layout.stacked()
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if self.load_special(name, tensor, params, loaded):
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in stacked:  # q_proj into its sibling qkv_proj, ...
                projection, shard = stacked[parts[-2]]
                target_name = ".".join(parts[:-2] + [projection.name.rsplit(".", 1)[-1], parts[-1]])
                target = params[target_name]
                start, n = self._rows(projection, target.shape[0])[shard]
                copy_into(target.narrow(0, start, n), tensor, name)
                loaded.add(f"{target_name}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            copy_into(params[name], tensor, name)
            loaded.add(name)
        missing = [n for n in params if n not in loaded and not any(
            key.startswith(n + "#") for key in loaded)]
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}{'…' if len(missing) > 5 else ''}")

    def load_special(self, name: str, tensor: torch.Tensor, params: dict, loaded: set[str]) -> bool:
        """Load a tensor the generic rules do not place (a subclass's experts); True if done."""
        return False

def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


Model = LlamaModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    other = sorted(set(getattr(hf, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        return f"{', '.join(other)} layers"
    return longrope_reason(hf)
