"""config.json read as JSON (models/config/hf_config.py) against transformers' AutoConfig: the same
ModelConfig and RoPE tables for every tiny architecture and the bundled model."""

import json

import pytest
import torch

from batchrun.models.config.hf_config import plain_config, read_config
from batchrun.models.arch.llama import ModelConfig
from batchrun.models.layers.rope import RotaryEmbedding
from tests.tiny_models import ARCHS, make_tiny


def _fields(cfg: ModelConfig) -> dict:
    return {k: v for k, v in cfg.__dict__.items() if k != "hf_config"}


def _same(folder):
    from transformers import AutoConfig

    ours, theirs = ModelConfig.from_hf(read_config(folder)), ModelConfig.from_hf(
        AutoConfig.from_pretrained(folder))
    assert _fields(ours) == _fields(theirs)
    a, b = RotaryEmbedding(ours), RotaryEmbedding(theirs)
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_architectures_read_the_same(tmp_path, arch):
    make_tiny(arch, tmp_path)
    _same(tmp_path)
    if arch != "llama3-rope":
        assert plain_config(tmp_path) is not None  # read without transformers
    else:
        assert plain_config(tmp_path) is None  # a RoPE variant: AutoConfig reads it


def test_the_bundled_model_reads_the_same():
    from batchrun.models.weights.resolve import resolve_model

    folder = resolve_model(None).path
    assert plain_config(folder) is not None
    _same(folder)


def test_left_out_keys_take_transformers_defaults(tmp_path):
    make_tiny("llama", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("rms_norm_eps", "tie_word_embeddings", "head_dim", "num_key_value_heads",
                "rope_parameters", "attention_bias", "hidden_act"):
        raw.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _same(tmp_path)
    raw["model_type"] = "gemma"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert plain_config(tmp_path) is None
