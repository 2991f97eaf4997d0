"""Native Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5's text model (Qwen3_5ForCausalLM): a hybrid
of linear-attention layers (the gated delta rule, models/layers/gated_delta_net.py, on the
engine's state slots) and full-attention layers (one in four in the released checkpoints) on the
paged KV cache, with moe.py's sparse MoE block (softmax top-k, a shared expert behind a sigmoid
gate) as the feed-forward.

What differs from llama.py's pieces: the full-attention layers' q_proj gives each head its query
and an output gate (attention * sigmoid(gate) before o_proj), per-head q/k RMS norms and rotary
on the first partial_rotary_factor of each head; every RMSNorm but the mixer's gated one scales
by (1 + w), folded into the weights at load as gemma.py does. The engine's KV layers are the
full-attention ones only (config.num_layers counts them); the linear-attention layers each
declare one state slot's tensors (`state_spec`), and the model takes each step's StepState.
Qwen3.5 is the same decoder with its mixer's input projections stored apart (QWEN3_5) and a
dense MLP; its multimodal RoPE is plain RoPE on text (the three position rows are equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

import torch
from torch import nn

from batchrun.engine.attention import AttentionMetadata, layer_metadata, paged_attention
from batchrun.engine.state_slots import StateSpec, StepState
from batchrun.models.arch import llama, moe
from batchrun.models.config import model_config
from batchrun.models.layers.gated_delta_net import (DeltaShape, GatedDeltaNet,
                                                    SplitGatedDeltaNet)
from batchrun.models.layers.projections import LayerLayout, Projection
from batchrun.models.layers.rope import RotaryEmbedding, StepRope, longrope_reason

SUPPORTED_ARCHITECTURES = {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"}
LINEAR, FULL = "linear_attention", "full_attention"

# Llama's names; a full-attention layer's q_proj holds each head's query and gate (rows of 2 x
# head_dim), and a linear-attention layer's two input projections both read the input norm
# (so neither folds SmoothQuant's factors into it).
QWEN3_NEXT = LayerLayout((
    Projection("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "input_layernorm", split="qkv"),
    Projection("self_attn.o_proj", ("self_attn.o_proj",)),
    Projection("linear_attn.in_proj_qkvz", ("linear_attn.in_proj_qkvz",)),
    Projection("linear_attn.in_proj_ba", ("linear_attn.in_proj_ba",)),
    Projection("linear_attn.out_proj", ("linear_attn.out_proj",)),
    Projection("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    Projection("mlp.down_proj", ("mlp.down_proj",)),
))
_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_5 = LayerLayout(QWEN3_NEXT.projections[:2] + tuple(
    Projection(f"linear_attn.{n}", (f"linear_attn.{n}",)) for n in _SPLIT)
    + QWEN3_NEXT.projections[4:])


@dataclass(frozen=True)
class ModelConfig(moe.ModelConfig):
    layer_types: tuple[str, ...] = ()  # every decoder layer's: LINEAR or FULL
    delta: DeltaShape | None = None  # the linear-attention layers' shape
    split_projections: bool = False  # Qwen3.5's mixer (SplitGatedDeltaNet)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "Qwen3NextForCausalLM")
        if getattr(hf, "text_config", None) is not None:
            raise ValueError("Qwen3.5's vision-language config (the text model's only)")
        fields = model_config.swiglu_fields(hf)
        types = tuple(hf.layer_types)
        if set(types) - {LINEAR, FULL}:
            raise ValueError(f"layer types {sorted(set(types) - {LINEAR, FULL})}")
        if hf.linear_num_value_heads % hf.linear_num_key_heads:
            raise ValueError("linear_num_value_heads not a multiple of linear_num_key_heads")
        experts = getattr(hf, "num_experts", 0) or 0
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        fields.update(num_layers=types.count(FULL), windows=())  # the KV layers
        return cls(
            **fields, qkv_bias=bool(getattr(hf, "attention_bias", False)), qk_norm=True,
            num_experts=experts, top_k=getattr(hf, "num_experts_per_tok", 0) or 0,
            expert_intermediate_size=getattr(hf, "moe_intermediate_size", 0) or 0,
            renormalize=bool(getattr(hf, "norm_topk_prob", False)),
            shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
            sparse_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                                for i in range(len(types))),
            layer_types=types, split_projections=hf.model_type == "qwen3_5_text",
            delta=DeltaShape(hf.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
                             hf.linear_key_head_dim, hf.linear_value_head_dim,
                             hf.linear_conv_kernel_dim, hf.rms_norm_eps))

    @property
    def state_spec(self) -> StateSpec:
        assert self.delta is not None  # from_hf sets it
        return StateSpec((self.delta.state_tensors(),) * self.layer_types.count(LINEAR),
                         checkpoints=True)  # GatedDeltaNet writes them (in pieces)

    @property
    def state_checkpoints(self) -> bool:
        return True

    @property
    def state_bytes_per_sequence(self) -> int:
        return self.state_spec.bytes_per_sequence


class Attention(llama.Attention):
    """Gated attention: qkv_proj's query rows are [query | gate] per head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)

    def forward(self, x, rope: StepRope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None  # qk_norm: always
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.rotate(q, *rope.cos_sin), RotaryEmbedding.rotate(k, *rope.cos_sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        gate = torch.sigmoid(gate.reshape(-1, self.q_size))
        out = out.reshape(-1, self.q_size).to(x.dtype) * gate
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        super().__init__()
        self.linear = cfg.layer_types[index] == LINEAR
        self.input_layernorm = llama.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.linear:
            assert cfg.delta is not None
            mixer = SplitGatedDeltaNet if cfg.split_projections else GatedDeltaNet
            self.linear_attn = mixer(cfg.delta)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = llama.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp


class Qwen3NextModel(moe.MoeModel):
    layer_class = DecoderLayer  # type: ignore[assignment]  # a hybrid's, not llama's

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.state_spec = cfg.state_spec

    def decoder_layer_count(self, cfg: model_config.ModelConfig) -> int:
        return len(cast(ModelConfig, cfg).layer_types)

    def make_layout(self, cfg: model_config.ModelConfig) -> LayerLayout:
        return QWEN3_5 if cast(ModelConfig, cfg).split_projections else QWEN3_NEXT

    def _rows(self, projection: Projection, total: int) -> list[tuple[int, int]]:
        if projection.split != "qkv":
            return super()._rows(projection, total)
        cfg = self.config
        q, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, kv), (q + kv, kv)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                state: StepState | None = None) -> torch.Tensor:
        if state is None:
            raise ValueError("Qwen3-Next's linear-attention layers need the step's state slots")
        x = self.embed(input_ids)
        rope = self.step_rope(positions, x.dtype)
        kernels = self.cpu_kernels
        if kernels is not None:
            x = x.float()  # the residual stream, as llama's
        layers = cast(Sequence[DecoderLayer], self.layers)
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        h = layers[0].input_layernorm.add_forward(None, x, kernels)
        kv_index = state_index = 0
        for layer, norm in zip(layers, norms):
            if layer.linear:
                mixed = layer.linear_attn(h, state, state.tensors[state_index], kernels)
                state_index += 1
            else:
                mixed = layer.self_attn(h, rope, kv_caches[kv_index],
                                        layer_metadata(meta, kv_index))
                kv_index += 1
            h = layer.post_attention_layernorm.add_forward(mixed, x, kernels)
            h = norm.add_forward(layer.mlp(h, kernels), x, kernels)
        return h

    def lora_targets(self):
        raise ValueError("LoRA adapters do not run on models with recurrent state yet")

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        for module in self.modules():  # Qwen3-Next's RMS norms scale by (1 + w)
            if isinstance(module, llama.RMSNorm):
                module.weight.add_(1)


Model = Qwen3NextModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        return f"activation {hf.hidden_act!r}"
    return longrope_reason(hf)
