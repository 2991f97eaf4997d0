"""Quantized linears inside the engine on tiny random models: weight-only modes decode exactly
what the same model with their dequantized weights decodes, and the quality gate's figures
(benchmarks/quality.py) come out computed and finite."""

import math

import pytest
import torch
from transformers import AutoConfig

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, build_model
from batchrun.models.arch.llama import LlamaModel, ModelConfig
from batchrun.models.quant import cpu
from batchrun.options.engine import EngineConfig
from tests.parity import ParityReport, assert_greedy_match
from tests.helpers import held_bytes
from tests.tiny_models import IdTokenizer, calibrate_int8_on_random_tokens, make_tiny

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _int8_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    calibrate_int8_on_random_tokens(monkeypatch)


def _engine(path, quantization="none", dtype=torch.float32, **options):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(LlamaModel, cfg, path, CPU, dtype, quantization)
    return build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4, **options), [2], CPU,
                        dtype)


def _dequantized_reference(quantized, path, monkeypatch, **options):
    """An engine over the same checkpoint with plain float linears holding `quantized`'s
    dequantized weights."""
    monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    reference = _engine(path, **options)
    replaced = 0
    for name, module in quantized.runner.model.named_modules():
        if hasattr(module, "dequantized_weight"):
            reference.runner.model.get_submodule(name).weight.data.copy_(module.dequantized_weight())
            replaced += 1
    assert replaced == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    return reference


def _assert_same_greedy(ours, refs, label):
    report = ParityReport()
    for i, (a, b) in enumerate(zip(ours, refs)):
        margins = [lp.top[0][1] - lp.top[1][1] for lp in b.outputs[0].logprobs]
        assert_greedy_match(a.outputs[0].token_ids, b.outputs[0].token_ids, margins,
                            f"{label}[{i}]", report)
    assert report.compared == len(refs)


def _prompts():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]


@pytest.mark.parametrize("arch", ["llama", "tied"])
@pytest.mark.parametrize("quantization", ["int8-weight", "int4-weight"])
def test_weight_only_greedy_matches_the_dequantized_model(arch, quantization, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)  # float32 compute, as the reference
    make_tiny(arch, tmp_path, intermediate_size=256, hidden_size=128)
    quantized = _engine(tmp_path, quantization)
    qmodel = quantized.runner.model
    assert type(qmodel.layers[0].mlp.gate_up_proj).__name__ != "PackedLinear"
    reference = _dequantized_reference(quantized, tmp_path, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    _assert_same_greedy(quantized.generate(_prompts(), params), reference.generate(_prompts(), params),
                        quantization)


def test_lora_adapters_run_on_a_quantized_base(tmp_path, monkeypatch):
    """The base GEMM quantized, each adapter's low-rank update in float on top of it."""
    from tests.lora_adapters import make_adapters

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    base = tmp_path / "base"
    hf = make_tiny("llama", base)
    lora = {name: path for name, (path, _) in make_adapters(hf, tmp_path).items()}
    quantized = _engine(base, "int4-weight", lora=lora)
    reference = _dequantized_reference(quantized, base, monkeypatch, lora=lora)
    jobs = [(p, name) for p in _prompts()[:2] for name in [None, *lora]]
    def params(name):
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, lora=name)
    prompts, settings = [p for p, _ in jobs], [params(n) for _, n in jobs]
    ours, refs = quantized.generate(prompts, settings), reference.generate(prompts, settings)
    _assert_same_greedy(ours, refs, "lora on int4")
    by_adapter = {name: out.outputs[0].token_ids for (p, name), out in zip(jobs[:len(lora) + 1], ours)}
    assert len({tuple(t) for t in by_adapter.values()}) > 1, "the adapters change nothing"


def test_quality_gate_figures_are_computed_and_finite(tmp_path):
    from benchmarks.quality import compare, table

    make_tiny("llama", tmp_path)
    engines = {"none:float32": _engine(tmp_path), "int8": _engine(tmp_path, "int8"),
               "int4-weight:bfloat16": _engine(tmp_path, "int4-weight", torch.bfloat16)}
    gen = torch.Generator().manual_seed(3)
    windows = [torch.randint(3, 512, (24,), generator=gen).tolist() for _ in range(2)]
    ref, int8, int4 = compare(engines, windows)
    assert ref.positions == int8.positions == 2 * 23
    assert ref.mean_kl == 0 and ref.top1 == 1
    for m in (int8, int4):
        assert math.isfinite(m.perplexity) and m.perplexity > 1
        assert math.isfinite(m.mean_kl) and m.mean_kl > 0
        assert 0 <= m.top1 <= 1
    assert "int4-weight:bfloat16" in table([ref, int8, int4])


@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.parametrize("arch", ["tied", "llama"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int8-weight", "int4-weight", "fp8", "bf16"])
def test_footprint_counts_the_quantized_weights(quantization, arch, fast_bf16, tmp_path, monkeypatch):
    from batchrun.footprint import weights_bytes
    from batchrun.models.quant.bf16_linear import Bf16Linear
    from batchrun.models.quant.int8_linear import Int8Linear

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: fast_bf16)
    make_tiny(arch, tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    model = build_model(LlamaModel, cfg, tmp_path, CPU, torch.float32, quantization)
    assert weights_bytes(cfg, "float32", quantization=quantization) == held_bytes(model)
    # int8's logits: calibrated int8 (quant/smoothquant.py); bf16's are float32
    assert isinstance(model.lm_head, Int8Linear) == (quantization == "int8")
    assert not isinstance(model.lm_head, Bf16Linear)


def test_plan_calibrates_quantized_runs_apart_from_float_ones():
    from batchrun.batch.estimate.job_estimate import run_key

    float_key = run_key("m", EngineConfig.default())
    assert float_key == "m|auto|kv=auto"  # unchanged: earlier runs' calibrations still apply
    assert run_key("m", EngineConfig.default(quantization="int8")) == "m|auto|kv=auto|q=int8"
