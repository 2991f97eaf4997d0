"""`batchrun models check` on each architecture of issue 25's parity matrix: the path it prints
(native and which model file, or the transformers backend) and the refusals with their reason,
from config files alone (tests/tiny_models.py's tiny configs, no weights)."""

from __future__ import annotations

import pytest

from tests.tiny_models import BACKEND_ARCHS, tiny_config

# The path each family of the matrix must take (written out here, not read from NATIVE_MODULES).
EXPECTED = {
    "llama": "native (models/arch/llama.py)",
    "mistral": "native (models/arch/llama.py)",
    "qwen2": "native (models/arch/llama.py)",
    "qwen3": "native (models/arch/llama.py)",
    "gemma": "native (models/arch/gemma.py)",
    "gemma2": "native (models/arch/gemma.py)",
    "gemma3_text": "native (models/arch/gemma.py)",
    "phi3": "native (models/arch/llama.py)",
    "stablelm": "native (models/arch/stablelm.py)",
    "bloom": "native (models/arch/bloom.py)",
    "falcon": "native (models/arch/falcon.py)",
    "gpt_neo": "native (models/arch/gpt_neo.py)",
    "olmo2": "transformers backend",
    "granite": "transformers backend",
    "glm4": "transformers backend",
    "smollm3": "transformers backend",
    "gpt_neox": "transformers backend",
    "mixtral": "native (models/arch/moe.py)",
    "qwen3_moe": "native (models/arch/moe.py)",
    "olmoe": "native (models/arch/moe.py)",
    "qwen2_moe": "native (models/arch/moe.py)",
    "deepseek_v2": "transformers backend",
    "gpt_oss": "native (models/arch/gpt_oss.py)",
    "llama4_text": "transformers backend",
}
# What the report lists for the families with something particular.
FEATURES = {
    "mistral": "sliding window: 8 tokens on 2 of 2 layers",
    "gemma2": "logit soft-capping: attn_logit_softcapping, final_logit_softcapping",
    "gemma3_text": "sliding window: 8 tokens on 1 of 2 layers",
    "mixtral": "LoRA: yes: q_proj, k_proj, v_proj, o_proj (on the fused qkv_proj); not the experts",
    "qwen3_moe": "MoE: 4 experts, 2 per token",
    "olmoe": "MoE: 4 experts, 2 per token",
    "qwen2_moe": "o_proj (on the fused qkv_proj), and gate_proj, up_proj, down_proj of its 1 "
                 "dense layer; not the experts",
    "deepseek_v2": "MLA: K/V expanded per head",
    "gpt_oss": "attention sinks: yes",
    "llama4_text": "chunked attention: 8 tokens on 2 of 4 layers",
}


def _check(folder):
    from click.testing import CliRunner

    from batchrun.models_cli import models

    return CliRunner().invoke(models, ["check", str(folder)])


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_each_family_of_the_matrix_gets_its_path(arch, tmp_path):
    config = tiny_config(arch, BACKEND_ARCHS)
    config.architectures = [BACKEND_ARCHS[arch][1]]
    config.save_pretrained(tmp_path)  # config.json only: no weights to read
    result = _check(tmp_path)
    assert result.exit_code == 0, result.output
    assert f"model: {tmp_path} ({arch}; {BACKEND_ARCHS[arch][1]})" in result.output
    path = EXPECTED[arch]
    reason = "it runs the model exactly" if path.startswith("native") else \
        f"the native path does not run it: model type '{arch}'"
    assert f"path: {path} ({reason}" in result.output
    layers = config.num_hidden_layers
    assert "parameters: " in result.output and f"KV cache: {layers} layers" in result.output
    if arch in FEATURES:
        assert FEATURES[arch] in result.output


@pytest.mark.parametrize("model_type,reason", [
    ("bailing_hybrid", "bailing_hybrid keeps a recurrent (state-space / linear-attention) state"),
    ("t5", "t5 is an encoder-decoder model"),
    ("bart", "bart is an encoder-decoder model"),
])
def test_recurrent_and_encoder_decoder_models_are_refused_with_the_reason(model_type, reason,
                                                                          tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    result = _check(tmp_path)
    assert result.exit_code == 2
    assert f"path: refused (unsupported model: {reason}" in result.output
    assert "parameters:" not in result.output
