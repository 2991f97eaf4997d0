"""The fast GGUF conversion (models/weights/gguf_weights.py) against transformers' on the bundled model:
the same tensors bit for bit, the same config values batchrun reads, the same tokenizer files."""

import json

import torch
from safetensors.torch import load_file

from batchrun.models.weights import gguf_weights, loader, registry
from batchrun.models.config.hf_config import read_config
from batchrun.models.arch.llama import ModelConfig


def test_fast_conversion_matches_transformers(tmp_path):
    gguf = registry.find_gguf(registry.lookup(registry.DEFAULT_MODEL))
    assert gguf_weights.supports(gguf)
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    loader._dequantise_gguf(gguf, fast)
    loader._dequantise_gguf_transformers(gguf, slow)
    a, b = load_file(fast / "model.safetensors"), load_file(slow / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = lambda folder: {k: v for k, v in ModelConfig.from_hf(read_config(folder)).__dict__.items()  # noqa: E731
                          if k != "hf_config"}
    assert cfg(fast) == cfg(slow)
    fast_cfg, slow_cfg = (json.loads((f / "config.json").read_text()) for f in (fast, slow))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "rope_parameters"):
        assert fast_cfg.get(key) == slow_cfg.get(key), key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (fast / name).read_bytes() == (slow / name).read_bytes(), name
