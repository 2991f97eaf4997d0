"""Quantized linears inside the engine on tiny random models: weight-only modes decode exactly
what the same model with their dequantized weights decodes, and the quality gate's figures
(benchmarks/quality.py) come out computed and finite."""

import math

import pytest
import torch
from transformers import AutoConfig

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, build_model
from batchrun.models.llama import LlamaModel, ModelConfig
from batchrun.models.quant import cpu
from batchrun.options.engine import EngineConfig
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import IdTokenizer, make_tiny

CPU = torch.device("cpu")


def _engine(path, quantization="none", dtype=torch.float32):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(LlamaModel, cfg, path, CPU, dtype, quantization)
    return build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, dtype)


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
    # The reference: the same checkpoint, plain float linears holding the dequantized weights.
    monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    reference = _engine(tmp_path)
    rmodel = reference.runner.model
    replaced = 0
    for name, module in qmodel.named_modules():
        if hasattr(module, "dequantized_weight"):
            rmodel.get_submodule(name).weight.data.copy_(module.dequantized_weight())
            replaced += 1
    assert replaced == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ours = quantized.generate(_prompts(), params)
    refs = reference.generate(_prompts(), params)
    report = ParityReport()
    for i, (a, b) in enumerate(zip(ours, refs)):
        margins = [lp.top[0][1] - lp.top[1][1] for lp in b.outputs[0].logprobs]
        assert_greedy_match(a.outputs[0].token_ids, b.outputs[0].token_ids, margins,
                            f"{quantization}[{i}]", report)
    assert report.compared == 4


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


def _held_bytes(model) -> int:
    """Every distinct tensor the model holds: parameters, and the tensors quantized and packed
    layers keep as attributes."""
    seen, total = set(), 0
    tensors = list(model.parameters())
    for module in model.modules():
        tensors += [v for k, v in vars(module).items() if isinstance(v, torch.Tensor)
                    and not k.startswith("_")]
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("quantization", ["none", "int8", "int8-weight", "int4-weight", "bf16"])
def test_footprint_counts_the_quantized_weights(quantization, tmp_path):
    from batchrun.footprint import weights_bytes

    make_tiny("tied", tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    model = build_model(LlamaModel, cfg, tmp_path, CPU, torch.float32, quantization)
    assert weights_bytes(cfg, "float32", quantization=quantization) == _held_bytes(model)
