"""Native mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) on llama.py's layers.

Attention, RoPE, norms and the dense MLP are llama.py's; what differs is the feed-forward block of
the sparse layers: a router picks top-k experts per token (softmax, then top-k, renormalised where
the config says), and the experts run as grouped GEMMs over the (token, expert) pairs sorted by
expert (models/layers/grouped_gemm.py), so a step costs what its active pairs cost, whatever the number
of experts. Qwen2-MoE adds a shared expert behind a sigmoid gate.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import cast

import torch
from torch import nn

from batchrun.engine.kernels import fallback_ops
from batchrun.models.arch import llama

from batchrun.models.config import model_config
from batchrun.models.layers.grouped_gemm import ExpertPairs, grouped_mm, route
from batchrun.models.arch.llama import MLP, LlamaModel
from batchrun.models.weights.tensor_copy import copy_into

SUPPORTED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
}
_EXPERT_COUNT = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class ModelConfig(model_config.ModelConfig):
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    renormalize: bool = False  # divide the top-k probabilities by their sum
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        archs = set(getattr(hf, "architectures", None) or ())
        if not archs & SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {sorted(archs)}; the native MoE path runs "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        model_type = hf.model_type
        experts = next((getattr(hf, n) for n in _EXPERT_COUNT if getattr(hf, n, None) is not None),
                       None)
        if not experts or not getattr(hf, "num_experts_per_tok", None):
            raise ValueError("the config names no experts (num_experts / num_local_experts and "
                             "num_experts_per_tok)")
        qwen = model_type in ("qwen2_moe", "qwen3_moe")
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        return cls(
            **model_config.swiglu_fields(hf),
            qkv_bias=bool(getattr(hf, "qkv_bias", False) or getattr(hf, "attention_bias", False)),
            qk_norm=model_type in ("qwen3_moe", "olmoe"),
            qk_norm_across_heads=model_type == "olmoe",
            num_experts=experts,
            top_k=hf.num_experts_per_tok,
            expert_intermediate_size=hf.moe_intermediate_size if qwen else hf.intermediate_size,
            renormalize=model_type == "mixtral" or bool(getattr(hf, "norm_topk_prob", False)),
            shared_expert_intermediate_size=(getattr(hf, "shared_expert_intermediate_size", 0)
                                             if model_type == "qwen2_moe" else 0),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0
                                for i in range(hf.num_hidden_layers)),
        )


class Experts(nn.Module):
    """The routed experts' weights as 3-D tensors, in transformers 5's layout: gate_up_proj
    [experts, 2 * intermediate, hidden] (gate rows first), down_proj [experts, hidden, intermediate]
    (and with `bias` one bias row per expert for each: GPT-OSS's)."""

    # checkpoints store these experts one SwiGLU expert at a time (gate/up/down_proj, Mixtral's
    # w1/w3/w2), which quant/ reads stored quantized into quant/experts.QuantizedExperts
    per_expert_swiglu = True
    interleaved_gate_up = False  # GPT-OSS's checkpoints alternate gate and up rows

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.activation: nn.Module | None = None  # SwiGLU; GPT-OSS's clamped one (a module)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias: nn.Parameter | None
        self.down_proj_bias: nn.Parameter | None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    def activate(self, gate_up: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        """The gated activation of rows [gate | up] (SwiGLU; models/arch/gpt_oss.py clamps it)."""
        if self.activation is not None:
            return self.activation(gate_up, cpu_kernels)
        return fallback_ops.gated_mul(gate_up, "silu", cpu_kernels)

    def project(self, rows: torch.Tensor, which: str, pairs: ExpertPairs, cpu_kernels=None) -> torch.Tensor:
        """rows [pairs, in] sorted by expert through each one's `which` projection ("gate_up_proj"
        or "down_proj"), bias included."""
        out = grouped_mm(rows, getattr(self, which), pairs, cpu_kernels)
        bias = getattr(self, f"{which}_bias")
        if bias is not None:
            out += bias[pairs.expert]
        return out

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                cpu_kernels=None) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for each token t."""
        return route(self, x, experts, weights, cpu_kernels)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.top_k, cfg.renormalize
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)
        self.shared_expert: MLP | None
        self.shared_expert_gate: nn.Linear | None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, experts, weights.to(x.dtype), cpu_kernels)
        if self.shared_expert is not None and self.shared_expert_gate is not None:  # set together
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, cpu_kernels)
        return out


# Per-expert checkpoint names (transformers 4 layout, and what transformers 5 still saves):
# expert tensor -> (fused parameter, shard: 0 gate, 1 up, None whole)
_PER_EXPERT = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
               "down_proj": ("down_proj", None), "w1": ("gate_up_proj", 0),
               "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


class MoeModel(LlamaModel):
    def make_mlp(self, cfg: model_config.ModelConfig, layer: int) -> nn.Module:
        moe_cfg = cast(ModelConfig, cfg)  # this family's config (from_hf made it)
        return SparseMoeBlock(moe_cfg) if moe_cfg.sparse_layers[layer] else MLP(cfg)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """As llama's, and a tensor loaded per expert must be there for every expert."""
        self._expert_parts: set[tuple[str, int, int | None]] = set()
        super().load_weights(weights)
        for name in sorted({name for name, _, _ in self._expert_parts}):
            shards = (0, 1) if name.endswith("gate_up_proj") else (None,)
            lacking = [(e, s) for e in range(self.get_parameter(name).shape[0]) for s in shards
                       if (name, e, s) not in self._expert_parts]
            if lacking:
                raise ValueError(f"checkpoint lacks expert weights of {name}: (expert, shard) "
                                 f"{lacking[:5]}{'…' if len(lacking) > 5 else ''}")

    def load_special(self, name: str, tensor: torch.Tensor, params: dict, loaded: set[str]) -> bool:
        """Experts, per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
        `block_sparse_moe.experts.3.w1.weight`) or fused (`mlp.experts.gate_up_proj`)."""
        renamed = name.replace(".block_sparse_moe.", ".mlp.")
        parts = renamed.split(".")
        at = parts.index("experts") if "experts" in parts else None
        if at is None or not parts[at + 1].isdigit():  # not per expert (fused ones are ours)
            if renamed == name:
                return False
            if renamed not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            copy_into(params[renamed], tensor, name)  # Mixtral's router
            loaded.add(renamed)
            return True
        prefix = ".".join(parts[:at + 1])
        expert, (target, shard) = int(parts[at + 1]), _PER_EXPERT[parts[at + 2]]
        weight = params[f"{prefix}.{target}"][expert]
        if shard is not None:
            half = weight.shape[0] // 2
            weight = weight.narrow(0, shard * half, half)
        copy_into(weight, tensor, name)
        loaded.add(f"{prefix}.{target}#{expert}.{shard}")
        self._expert_parts.add((f"{prefix}.{target}", expert, shard))
        return True


Model = MoeModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    if getattr(hf, "clip_qkv", None) is not None:
        return f"clip_qkv {hf.clip_qkv} (the native MoE path does not clamp q/k/v)"
    if hf.model_type == "olmoe" and getattr(hf, "attention_bias", False):
        return "attention_bias on OLMoE (o_proj bias)"
    return llama.unsupported(hf)
