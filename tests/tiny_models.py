"""Tiny random-weight checkpoints of each supported architecture, built with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
}


def make_tiny(arch: str, path: Path, seed: int = 0, **overrides):
    """Save a tiny random model to `path`; returns the transformers model (fp32, eval).
    `overrides` change its config (vocab_size to match a real tokenizer, say)."""
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    options = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False)
    options.update(extra)
    options.update(overrides)
    cfg = getattr(transformers, cfg_cls)(**options)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    model.save_pretrained(path)
    return model


class IdTokenizer:
    """Stands in for a tokenizer where tests only need ids: token i decodes to "<i>"."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == 2))
