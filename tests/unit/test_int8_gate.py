"""int8's load gate (models/quant/gate.py): the finished int8 model against the float model it
came from, on this machine's kernels. A tiny Llama whose logits head is scaled up has decisive
next-token choices to compare; with the int8 GEMM made to compute wrong sums (what an inexact
kernel on some CPU kind would do) the load is refused by name; a sound one loads, judged."""

import logging

import pytest
import torch
from transformers import AutoConfig

from batchrun.llm import build_model
from batchrun.models.arch.llama import LlamaModel, ModelConfig
from batchrun.models.quant import QuantizationError, calibration, gate, int8_linear
from tests.tiny_models import calibrate_int8_on_random_tokens, make_tiny


@pytest.fixture
def peaked(tmp_path, monkeypatch):
    """A tiny Llama whose logits lead by nats, not hundredths (a random head's are flat)."""
    monkeypatch.setattr(calibration, "cache_path", lambda files, method, dtype: tmp_path / f"{method}.pt")
    calibrate_int8_on_random_tokens(monkeypatch)
    hf = make_tiny("llama", tmp_path / "model")
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)
    hf.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _load(path):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    return build_model(LlamaModel, cfg, path, torch.device("cpu"), torch.float32, "int8")


def test_a_sound_int8_model_loads_judged_well_above_the_refusal_line(peaked, caplog):
    """A random model quantizes worse than a trained one (the bundled model: 93 of 93 decisive
    positions agree), so it may be warned about, but it is judged and loads."""
    with caplog.at_level(logging.INFO, logger="batchrun.models.quant.gate"):
        _load(peaked)
    said = [r.getMessage() for r in caplog.records if "decisive positions" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    agree, decisive = (int(n) for n in said[0].split("token at ")[1].split(" decisive")[0].split(" of "))
    assert decisive >= gate.MIN_DECISIVE and agree / decisive >= gate.REFUSE_BELOW + 0.05


def test_an_int8_gemm_with_wrong_sums_is_refused(peaked, monkeypatch):
    if not int8_linear.onednn_int8_available():
        pytest.skip("no int8 GEMM runs here (the float emulation does)")
    exact = int8_linear.Int8Linear.kernel_gemm  # the AMX kernel or oneDNN's, as this CPU has

    def off_by_some(layer, ux):  # sums off by ~3%, as a broken kernel's
        y = exact(layer, ux)
        return y + 0.5 * y.abs().mean() * torch.randn_like(y)

    monkeypatch.setattr(int8_linear.Int8Linear, "kernel_gemm", off_by_some)
    with pytest.raises(QuantizationError, match="computes wrong answers on this CPU"):
        _load(peaked)
