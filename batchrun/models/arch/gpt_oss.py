"""Native GPT-OSS decoder: models/arch/moe.py's experts and llama.py's layers with what GPT-OSS adds.

- attention: q/k/v/o with biases, a learned sink logit per head that joins each row's softmax
  denominator only (the engine's attention takes it, engine/attention/), sliding-window layers
  alternating with full ones (layer_types, through the KV groups), YaRN RoPE (models/layers/rope.py);
- router: a linear with bias, top-k of its logits, then a softmax over the chosen ones;
- experts: biased gate_up/down as grouped GEMMs over the (token, expert) pairs, with the clamped
  gated activation (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit.
Checkpoints store the experts as transformers does: gate_up_proj [experts, hidden, 2I] with gate
and up columns interleaved, down_proj [experts, I, hidden]; they are reordered at load into
moe.Experts' [experts, out, in] layout, gate rows first. MXFP4 checkpoints (the experts
quantized, as OpenAI ships GPT-OSS) are read by models/quant/mxfp4.py into quantized experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import cast

import torch
from torch import nn

from batchrun.models.arch import llama, moe

from batchrun.models.config import model_config
from batchrun.models.arch.llama import Attention
from batchrun.models.weights.tensor_copy import copy_into

SUPPORTED_ARCHITECTURES = {"GptOssForCausalLM"}


@dataclass(frozen=True)
class ModelConfig(moe.ModelConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_config.require_architecture(hf, SUPPORTED_ARCHITECTURES, "GptOssForCausalLM")
        return cls(**model_config.shape_fields(hf),
                   qkv_bias=bool(getattr(hf, "attention_bias", True)),
                   qk_norm=False, num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                   expert_intermediate_size=hf.intermediate_size,
                   sparse_layers=(True,) * hf.num_hidden_layers,
                   swiglu_alpha=hf.swiglu_alpha, swiglu_limit=hf.swiglu_limit)


class SinkAttention(Attention):
    """llama's attention with an o_proj bias (when the config has attention biases) and sinks."""

    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__(cfg, window)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.qkv_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module):
        super().__init__(cfg, index, mlp)
        self.self_attn = SinkAttention(cfg, cfg.windows[index] if cfg.windows else None)


class ClampedSwiGLU(nn.Module):
    """(up + 1) * gate * sigmoid(alpha * gate) of rows [gate | up], gate <= limit, |up| <= limit."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))


class ClampedExperts(moe.Experts):
    per_expert_swiglu = False  # fused 3-D tensors with biases and a clamped activation
    interleaved_gate_up = True  # checkpoints alternate gate and up rows (expert_tensor)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size, bias=True)
        self.activation = ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)


class MoeBlock(nn.Module):
    """The router (named `gate` as the other MoE models' are: kept float under --quantization)
    and the experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = ClampedExperts(cfg)

    def forward(self, x: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
        top, experts = self.gate(x).topk(self.top_k, dim=-1)
        return self.experts(x, experts, torch.softmax(top, dim=-1), cpu_kernels)


def _gate_rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along `dim` (gate at even indices) as [gate | up]."""
    index = torch.arange(t.shape[dim])
    return t.index_select(dim, torch.cat((index[0::2], index[1::2])))


def expert_tensor(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's expert tensor (`kind`: the name's last part) in ClampedExperts' layout."""
    if kind == "gate_up_proj":  # [experts, hidden, 2I] interleaved -> [experts, 2I, hidden]
        return _gate_rows_first(tensor.transpose(1, 2), 1)
    if kind == "gate_up_proj_bias":
        return _gate_rows_first(tensor, 1)
    if kind == "down_proj":  # [experts, I, hidden] -> [experts, hidden, I]
        return tensor.transpose(1, 2)
    if kind == "down_proj_bias":
        return tensor
    raise ValueError(f"unexpected expert tensor {kind!r}")


class GptOssModel(moe.MoeModel):
    layer_class = DecoderLayer

    def make_mlp(self, cfg: model_config.ModelConfig, layer: int) -> nn.Module:
        return MoeBlock(cast(ModelConfig, cfg))  # this family's config (from_hf made it)

    def load_special(self, name: str, tensor: torch.Tensor, params: dict, loaded: set[str]) -> bool:
        """The router (`mlp.router.*` -> `mlp.gate.*`) and the experts, reordered (module doc)."""
        if ".mlp.router." in name:
            name = name.replace(".mlp.router.", ".mlp.gate.")
        elif ".mlp.experts." in name:
            tensor = expert_tensor(name.rsplit(".", 1)[-1], tensor)
        else:
            return False
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        copy_into(params[name], tensor, name)
        loaded.add(name)
        return True


Model = GptOssModel


def unsupported(hf) -> str | None:
    """What ModelConfig.from_hf accepts that this model would not run exactly."""
    return llama.unsupported(hf)
