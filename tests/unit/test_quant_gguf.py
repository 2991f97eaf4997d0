"""GGUF Q4_0 / Q4_1 / Q8_0 linears kept quantized (models/quant/gguf.py): per layer against the
gguf package's reference dequantisation, and end to end on a tiny model whose projections come
from a GGUF file."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoConfig

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, build_model
from batchrun.models.llama import LlamaModel, ModelConfig
from batchrun.models.quant import cpu
from batchrun.models.quant.gguf import GgufLinears, q4_groups, source_of
from batchrun.models.quant.int4_linear import Int4WeightLinear
from batchrun.models.quant.int8_linear import Int8WeightLinear
from batchrun.options.engine import EngineConfig
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import IdTokenizer, make_tiny

Q = GGMLQuantizationType
CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_are_int4_groups_exactly(kind):
    w = np.random.default_rng(0).standard_normal((128, 96)).astype(np.float32)
    raw = quantize(w, kind)
    reference = dequantize(raw, kind)
    q, d, m = (torch.from_numpy(a) for a in q4_groups(raw.reshape(-1), int(kind), 128, 96))
    layer = Int4WeightLinear(None, None, q=q, scale=d, minimum=m)
    np.testing.assert_allclose(layer.dequantized_weight().numpy(), reference, rtol=0, atol=1e-6)


def test_q8_blocks_requantized_per_channel_stay_within_a_step():
    w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    reference = dequantize(quantize(w, Q.Q8_0), Q.Q8_0)
    layer = Int8WeightLinear(torch.from_numpy(reference), None)
    step = layer.w_scale[:, None].numpy()
    assert (np.abs(layer.dequantized_weight().numpy() - reference) <= step / 2 + 1e-7).all()


def _permute(w, heads):  # llama.cpp's q/k row order, undone by gguf_weights.unpermute
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, 2, dim, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf, path, kinds):
    """The projections of a tiny transformers model into a GGUF file, quantized as `kinds`
    says per projection (others Q4_1)."""
    cfg = hf.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32("llama.attention.head_count_kv", cfg.num_key_value_heads)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i, layer in enumerate(hf.model.layers):
        for module, part in names.items():
            w = layer.get_submodule(module).weight.detach().numpy()
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(part)
            if heads:
                w = _permute(w, heads)
            kind = kinds.get(part, Q.Q4_1)
            writer.add_tensor(f"blk.{i}.{part}.weight", quantize(np.ascontiguousarray(w), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _engine(path, quantization="none"):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(LlamaModel, cfg, path, CPU, torch.float32, quantization)
    return build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, torch.float32)


def test_a_gguf_models_projections_load_quantized_and_decode_as_its_dequantisation(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)  # float32 compute, as the reference
    hf = make_tiny("llama", tmp_path)
    gguf_path = tmp_path / "tiny.gguf"
    _write_gguf(hf, gguf_path, {"attn_v": Q.Q4_0, "ffn_down": Q.Q8_0})
    (tmp_path / "gguf_source.txt").write_text(str(gguf_path))
    assert source_of(tmp_path) == gguf_path
    quantized = _engine(tmp_path, "int4-weight")
    attn = quantized.runner.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int4WeightLinear) and isinstance(attn.o_proj, Int4WeightLinear)

    # The reference: float layers holding the gguf package's dequantisation of every tensor.
    gguf = GgufLinears(gguf_path)
    monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    reference = _engine(tmp_path)
    for i, layer in enumerate(reference.runner.model.layers):
        for fused, parts in {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
                             "self_attn.o_proj": ("attn_output",),
                             "mlp.gate_up_proj": ("ffn_gate", "ffn_up")}.items():
            weight = torch.cat([gguf.float_weight(f"blk.{i}.{p}.weight", p) for p in parts])
            exact = quantized.runner.model.layers[i].get_submodule(fused).dequantized_weight()
            torch.testing.assert_close(exact, weight, rtol=0, atol=1e-6)  # Q4_0 / Q4_1: exact
            layer.get_submodule(fused).weight.data.copy_(weight)
        # ffn_down is Q8_0: dequantized, then int4 groups as any float layer (not exact)
        layer.mlp.down_proj.weight.data.copy_(quantized.runner.model.layers[i].mlp.down_proj.dequantized_weight())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    report = ParityReport()
    for i, (a, b) in enumerate(zip(quantized.generate(prompts, params), reference.generate(prompts, params))):
        margins = [lp.top[0][1] - lp.top[1][1] for lp in b.outputs[0].logprobs]
        assert_greedy_match(a.outputs[0].token_ids, b.outputs[0].token_ids, margins, f"gguf[{i}]", report)
    assert report.compared == 3
