"""The GPU benchmark's random-weight checkpoints: shaped like Llama-3.2-1B and like Qwen3-30B-A3B
at reduced depth (weights do not change speed), or tiny versions of both for a CPU dry run."""

from __future__ import annotations

from pathlib import Path

import torch

# hidden, layers, heads, KV heads, head_dim and MLP widths as the released configs have them;
# contexts of 8-16k (the RoPE tables stay small).
SHAPES = {
    "llama-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=16384,
        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    # 4 of its 48 layers: 128 experts of width 768, 8 per token, as released.
    "qwen3-30b-a3b-4l": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0)),
}
# --dry-run: the same families small enough for seconds on a CPU (the vocabulary still covers
# the bundled tokenizer's 49,152 ids).
TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 49152}


def hf_config(name: str, tiny: bool = False):
    import transformers

    cls, fields = SHAPES[name]
    fields = dict(fields)
    if tiny:
        fields.update({k: v for k, v in TINY.items() if k in fields})
    return getattr(transformers, cls)(**fields)


def make_checkpoint(name: str, path: Path, device: torch.device, dtype: torch.dtype,
                    tiny: bool = False):
    """Random weights (transformers' own initialisation, built on `device`) saved to `path`;
    returns the transformers model, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(name, tiny), dtype=dtype).eval()
    model.save_pretrained(path)
    return model
