"""Every model object the engine runs satisfies engine/model.py's NativeModel Protocol (the
native families, the transformers backend's wrapper, a vision-language model), and only the
vision-language one has the TakesImages capability; a text model refuses an image request by
that capability, not by an attribute lookup."""

import pytest
import torch

from batchrun.engine.model import NativeModel, TakesImages
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.sampling_params import SamplingParams
from batchrun.llm import load_from_path, load_weights
from batchrun.options.engine import EngineConfig
from tests.helpers import tiny_engine
from tests.tiny_models import BACKEND_ARCHS, make_tiny
from tests.tiny_vlms import make_tiny_vlm


def _shape_ok(model) -> None:
    cfg = model.config
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert isinstance(getattr(cfg, field), int) and getattr(cfg, field) > 0, field


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_moe", "gpt_oss"])
def test_native_families_are_native_models_without_images(arch, tmp_path):
    _, engine = tiny_engine(arch, tmp_path)
    model = engine.runner.model
    assert isinstance(model, NativeModel) and not isinstance(model, TakesImages)
    _shape_ok(model)
    assert model.num_labels == 0
    with pytest.raises(ValueError, match="takes text only"):
        engine.add_request("img", [5, 6, 7], SamplingParams(max_tokens=1),
                           multimodal=MultiModalInputs(images=[]))


def test_the_transformers_backend_and_a_vlm_are_native_models(tmp_path, smol_tokenizer):
    make_tiny("olmo2", tmp_path / "text", archs=BACKEND_ARCHS)
    text = load_weights(tmp_path / "text", EngineConfig.default(model_impl="transformers"),
                        torch.device("cpu"), torch.float32)
    assert isinstance(text, NativeModel) and not isinstance(text, TakesImages)
    _shape_ok(text)
    make_tiny_vlm("llava", tmp_path / "vlm", smol_tokenizer)
    vlm = load_from_path(tmp_path / "vlm", EngineConfig.default(block_size=4, num_blocks=256))
    assert isinstance(vlm.engine.runner.model, NativeModel)
    assert isinstance(vlm.engine.runner.model, TakesImages)
