"""The load check (batchrun/models/load_check.py): a model whose engine path differs from
transformers' own forward on the same weights is refused with the figure, never served; one that
agrees loads (every architecture of the parity matrices loads through it)."""

import pytest
import torch

from batchrun.llm import load_weights
from batchrun.models.arch import llama
from batchrun.models.load_check import LoadCheckError
from batchrun.models.transformers.attention import Step
from batchrun.models.transformers.model import TransformersModel
from batchrun.options.engine import EngineConfig
from tests.tiny_models import BACKEND_ARCHS, make_tiny

CPU = torch.device("cpu")


def load(path, impl, dtype=torch.float32):
    return load_weights(path, EngineConfig.default(model_impl=impl), CPU, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_backend_model_whose_cache_serves_wrong_values_is_refused(tmp_path, monkeypatch, dtype):
    """DiffLlama as the backend ran it before a layer's second attention call had a cache of its
    own (the second call's values overwrote the first's): refused, with the figure, the step
    and the layer, in float32 and in bfloat16 (judged there by the RMS of the difference)."""
    make_tiny("diffllama", tmp_path, archs=BACKEND_ARCHS)
    assert isinstance(load(tmp_path, "transformers", dtype), TransformersModel)  # as it is: exact
    monkeypatch.setattr(Step, "cache_index", lambda self, layer: layer)
    with pytest.raises(LoadCheckError) as refused:
        load(tmp_path, "transformers", dtype)
    message = str(refused.value)
    figure = float(message.split("max |Δlogit| ")[1].split(",")[0])
    assert figure > 1, message  # the wrong values change the logits by whole units
    assert "reading the first's KV cache" in message  # the first step that reads the cache
    assert "first layer whose output differs: 0 (DiffLlamaAttention" in message


def test_a_native_model_that_differs_is_refused_or_runs_on_the_backend(tmp_path, monkeypatch,
                                                                       caplog):
    """A native Llama whose attention scale is off: --model-impl native refuses it; auto runs it
    on the transformers backend (a path that agrees) and says why."""
    make_tiny("llama", tmp_path, archs=BACKEND_ARCHS)
    assert isinstance(load(tmp_path, "native"), llama.LlamaModel)
    real_init = llama.Attention.__init__

    def off_scale(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.scale *= 1.5

    monkeypatch.setattr(llama.Attention, "__init__", off_scale)
    with pytest.raises(LoadCheckError, match=r"first 2 layers.*max \|Δlogit\| [0-9.]+"):
        load(tmp_path, "native")
    assert isinstance(load(tmp_path, "auto"), TransformersModel)
    assert "running it on the transformers backend" in caplog.text


def test_a_native_model_loads_with_a_warning_where_transformers_cannot_build_the_reference(
        tmp_path, monkeypatch, caplog):
    from batchrun.models import native_check

    make_tiny("qwen3", tmp_path, archs=BACKEND_ARCHS)

    def cannot(*args, **kwargs):
        raise ValueError("no such architecture in this transformers")

    monkeypatch.setattr(native_check, "cache_path", lambda *a: tmp_path / "none" / "x.pt")
    monkeypatch.setattr(native_check, "reference_logits", cannot)
    assert isinstance(load(tmp_path, "native"), llama.LlamaModel)
    assert "load check skipped" in caplog.text and "no such architecture" in caplog.text
