"""PEFT LoRA adapters made for the tests, and their reference outputs through transformers + peft.

`init_lora_weights=False` gives lora_B random values (PEFT's default is zeros, an adapter that
changes nothing), so each adapter's greedy output differs from the base model's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (targets, rank, alpha, use_rslora): attention only, everything, MLP only.
KINDS = [(["q_proj", "v_proj"], 4, 16, False), (ALL, 8, 16, True), (["up_proj", "down_proj"], 6, 12, False)]
# Phi-3's checkpoint has fused linears, PEFT's targets there.
PHI3_KINDS = [(["qkv_proj"], 4, 16, False), (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 8, 16, True),
              (["gate_up_proj", "down_proj"], 6, 12, False)]
# BLOOM's (and Falcon's) names: q/k/v one linear, a two-linear GELU MLP.
BLOOM_KINDS = [(["query_key_value"], 4, 16, False),
               (["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], 8, 16, True),
               (["dense_h_to_4h", "dense_4h_to_h"], 6, 12, False)]
# GPT-Neo's: q/k/v apart (fused in the native model), out_proj, c_fc / c_proj.
GPT_NEO_KINDS = [(["q_proj", "v_proj"], 4, 16, False),
                 (["q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"], 8, 16, True),
                 (["c_fc", "c_proj"], 6, 12, False)]


def make_adapter(hf, path: Path, seed: int, targets, r: int = 4, alpha: int = 16,
                 rslora: bool = False, scale_b: float = 1.0):
    """Save a random LoRA adapter of `hf` (left untouched) to `path`; returns the PEFT model.
    `targets`: module names, or a regex over full module names (PEFT's target_modules)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets if isinstance(targets, str) else list(targets), init_lora_weights=False,
        use_rslora=rslora, lora_dropout=0.0))
    if scale_b != 1.0:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale_b)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def make_adapters(hf, root: Path, kinds=None, scale_b: float = 1.0) -> dict[str, tuple[str, object]]:
    """name -> (folder, PEFT model) for one adapter of each kind (default: KINDS, PHI3_KINDS
    on Phi-3, BLOOM_KINDS on BLOOM and Falcon, GPT_NEO_KINDS on GPT-Neo)."""
    if kinds is None:
        kinds = {"phi3": PHI3_KINDS, "bloom": BLOOM_KINDS, "falcon": BLOOM_KINDS,
                 "gpt_neo": GPT_NEO_KINDS}.get(
            hf.config.model_type, KINDS)
    out = {}
    for i, (targets, r, alpha, rslora) in enumerate(kinds):
        path = root / f"adapter{i}"
        out[f"tune{i}"] = (str(path), make_adapter(hf, path, 100 + i, targets, r, alpha, rslora,
                                                   scale_b))
    return out


def reference(model, prompt: list[int], max_new: int, eos: int = -1):
    """Greedy tokens and their logits from transformers' generate."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=eos if eos >= 0 else None)
    return out.sequences[0, len(prompt):].tolist(), [l[0] for l in out.logits]
