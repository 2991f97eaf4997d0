"""GGUF linears kept quantized (models/quant/gguf.py, gguf_blocks.py): Q4_0 / Q4_1 / Q4_K as
int4 groups, Q8_0 / Q5_K / Q6_K as grouped int8, per layer against the gguf package's reference
dequantisation, and end to end on tiny models whose projections come from a GGUF file."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoConfig

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, build_model
from batchrun.models_cli import models
from batchrun.models.arch.llama import LlamaModel, ModelConfig
from batchrun.engine import kernels
from batchrun.footprint import weights_bytes
from batchrun.models.quant import QuantizationError, cpu, gguf_blocks
from batchrun.models.quant.gguf import GgufLinears, StackedLinear, family_of, module_of, source_of
from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear
from batchrun.models.quant.int4_linear import Int4WeightLinear
from batchrun.models.quant.int8_linear import Int8WeightLinear
from batchrun.models.config.spec_config import gguf_file
from batchrun.options.engine import EngineConfig
from tests import gguf_kquants
from tests.helpers import held_bytes
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import IdTokenizer, make_tiny

Q = GGMLQuantizationType
CPU = torch.device("cpu")


KEPT = {Q.Q4_0: Int4WeightLinear, Q.Q4_1: Int4WeightLinear, Q.Q4_K: Int4WeightLinear,
        Q.Q8_0: GroupedInt8Linear, Q.Q5_K: GroupedInt8Linear, Q.Q6_K: GroupedInt8Linear}
_SCALE_BYTES = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def _random_blocks(kind, rows, cols, rng):
    """Blocks of random bytes (every bit pattern of q, sub-scales and mins) with finite fp16 d."""
    block, nbytes = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q8_0: (32, 34), Q.Q4_K: (256, 144),
                     Q.Q5_K: (256, 176), Q.Q6_K: (256, 210)}[kind]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for at in _SCALE_BYTES[kind]:
        d = (rng.standard_normal((rows, cols // block, 1)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(KEPT))
def test_blocks_load_exactly_as_gguf_dequantizes_them(kind, monkeypatch):
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)  # float32 compute even so
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 512)).astype(np.float32) * 0.1
    for raw in (_random_blocks(kind, 128, 512, rng), gguf_kquants.quantize(w, kind)):
        reference = dequantize(raw, kind)
        layer = module_of(family_of(int(kind)), [gguf_blocks.groups(raw.reshape(-1), int(kind), 128, 512)])
        assert type(layer) is KEPT[kind]
        np.testing.assert_allclose(layer.dequantized_weight().numpy(), reference, rtol=1e-6, atol=1e-7)
        x = torch.randn(3, 512)
        expected = (x.double() @ torch.from_numpy(reference).double().T).float()
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    # the hand-built K-quant blocks are the weights they encode, to the type's precision
    assert np.abs(dequantize(gguf_kquants.quantize(w, kind), kind) - w).max() < 0.25 * np.abs(w).max()


def test_grouped_int8_layer_runs_the_kernel_for_decode_rows(monkeypatch):
    lib = kernels.library(("-DNO_SPECIALISED",))
    if lib is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    w = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    raw = gguf_kquants.quantize(w, Q.Q5_K)
    layer = module_of("int8/32", [gguf_blocks.groups(raw.reshape(-1), int(Q.Q5_K), 64, 256)])
    layer.kernels = lib
    calls = []
    monkeypatch.setattr(layer, "kernel_forward", lambda x, f=layer.kernel_forward: calls.append(1) or f(x))
    x = torch.randn(2, 256)
    expected = (x.double() @ torch.from_numpy(dequantize(raw, Q.Q5_K)).double().T).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert calls == [1]


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
    says per projection (others Q4_1; K-quants by tests/gguf_kquants.py)."""
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
            writer.add_tensor(f"blk.{i}.{part}.weight", gguf_kquants.quantize(np.ascontiguousarray(w), kind),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _engine(path, quantization="none"):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(LlamaModel, cfg, path, CPU, torch.float32, quantization)
    return build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, torch.float32)


def _assert_decodes_as(quantized, reference, label: str) -> None:
    """Greedy decoding of three random prompts matches the reference engine's (tie rule:
    tests/parity.py, on the reference's own top-2 margins)."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    report = ParityReport()
    for i, (a, b) in enumerate(zip(quantized.generate(prompts, params), reference.generate(prompts, params))):
        margins = [lp.top[0][1] - lp.top[1][1] for lp in b.outputs[0].logprobs]
        assert_greedy_match(a.outputs[0].token_ids, b.outputs[0].token_ids, margins, f"{label}[{i}]", report)
    assert report.compared == 3


# llama.cpp's Q4_K_M mix (attn_v and ffn_down in Q6_K beside Q4_K) and every other kept type
K_MIX = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
         "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q6_K}
CASES = {  # quantization, projection types, model size (K-quants need inputs in 256s)
    "int4-weight": ("int4-weight", {"attn_v": Q.Q4_0, "ffn_down": Q.Q8_0}, {}),
    "gguf-k-quants": ("gguf", K_MIX, {"hidden_size": 256, "intermediate_size": 512}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_gguf_models_projections_load_quantized_and_decode_as_its_dequantisation(case, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)  # float32 compute even so
    quantization, kinds, size = CASES[case]
    hf = make_tiny("llama", tmp_path, **size)
    gguf_path = tmp_path / "tiny.gguf"
    _write_gguf(hf, gguf_path, kinds)
    (tmp_path / "gguf_source.txt").write_text(str(gguf_path))
    assert source_of(tmp_path) == gguf_path
    quantized = _engine(tmp_path, quantization)
    layer0 = quantized.runner.model.layers[0]
    if quantization == "gguf":  # each part in its own format; mixed fused projections stacked
        assert isinstance(layer0.self_attn.qkv_proj, StackedLinear)
        assert [type(m) for m in layer0.self_attn.qkv_proj.parts] == [Int4WeightLinear, GroupedInt8Linear]
        assert [type(m) for m in layer0.mlp.gate_up_proj.parts] == [GroupedInt8Linear, Int4WeightLinear]
        assert isinstance(layer0.self_attn.o_proj, GroupedInt8Linear)
        assert layer0.mlp.down_proj.group == 16 and layer0.mlp.down_proj.kernels is not None
        # `batchrun plan`'s weight bytes: the blocks as the loaded modules hold them
        cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
        assert gguf_file(str(tmp_path)) == gguf_path
        held = held_bytes(quantized.runner.model)
        assert weights_bytes(cfg, "float32", quantization="gguf", gguf=gguf_path) == held
        check = CliRunner().invoke(models, ["check", str(tmp_path)]).output
        assert f"--quantization gguf: weights {held / 2**20:.1f} MiB" in check
    else:
        assert isinstance(layer0.self_attn.qkv_proj, Int4WeightLinear)
        assert isinstance(layer0.self_attn.o_proj, Int4WeightLinear)

    # The reference: float layers holding the gguf package's dequantisation of every tensor.
    gguf = GgufLinears(gguf_path)
    monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    reference = _engine(tmp_path)
    for i, layer in enumerate(reference.runner.model.layers):
        for fused, parts in {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
                             "self_attn.o_proj": ("attn_output",),
                             "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
                             "mlp.down_proj": ("ffn_down",)}.items():
            weight = torch.cat([gguf.float_weight(f"blk.{i}.{p}.weight", p) for p in parts])
            kept = quantized.runner.model.layers[i].get_submodule(fused).dequantized_weight()
            if quantization == "int4-weight" and fused == "mlp.down_proj":
                weight = kept  # Q8_0 under int4-weight: requantized into int4 groups (not exact)
            torch.testing.assert_close(kept, weight, rtol=1e-6, atol=1e-6)  # the blocks exactly
            layer.get_submodule(fused).weight.data.copy_(weight)
    _assert_decodes_as(quantized, reference, "gguf")


def test_gguf_mode_refuses_a_block_type_it_cannot_keep_naming_the_tensor(tmp_path):
    hf = make_tiny("llama", tmp_path)
    _write_gguf(hf, tmp_path / "tiny.gguf", {"ffn_up": Q.Q5_0})
    (tmp_path / "gguf_source.txt").write_text(str(tmp_path / "tiny.gguf"))
    with pytest.raises(QuantizationError, match=r"blk\.0\.ffn_up\.weight is Q5_0"):
        _engine(tmp_path, "gguf")


def test_gguf_mode_refuses_a_checkpoint_that_is_not_gguf(tmp_path):
    make_tiny("llama", tmp_path)
    with pytest.raises(QuantizationError, match="not a GGUF model"):
        _engine(tmp_path, "gguf")


def _write_arch_gguf(hf, path, arch, kinds):
    """A tiny model of GGUF architecture `arch` (q/k rows as stored: llama.cpp permutes them for
    `llama` only) with its MoE layers' routed experts as 3-D ffn_*_exps tensors [experts, out, in]."""
    cfg = hf.config
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output"}
    for i, layer in enumerate(hf.model.layers):
        tensors = {part: layer.get_submodule(m).weight.detach().numpy() for m, part in names.items()}
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:  # transformers' [experts, 2 * inter, hidden], gate rows first
            gate, up = experts.gate_up_proj.detach().numpy().reshape(
                experts.gate_up_proj.shape[0], 2, -1, experts.gate_up_proj.shape[-1]).swapaxes(0, 1)
            tensors.update(ffn_gate_exps=gate, ffn_up_exps=up, ffn_down_exps=experts.down_proj.detach().numpy())
        else:
            tensors.update({p: layer.mlp.get_submodule(m).weight.detach().numpy()
                            for m, p in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))})
        for part, w in tensors.items():
            kind = kinds.get(part, Q.Q4_1)
            flat = np.ascontiguousarray(w.reshape(-1, w.shape[-1]), dtype=np.float32)
            blocks = gguf_kquants.quantize(flat, kind)
            writer.add_tensor(f"blk.{i}.{part}.weight", blocks.reshape(*w.shape[:-1], -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, gguf_arch", [("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe")])
def test_a_gguf_of_another_architecture_keeps_its_blocks_and_experts_and_decodes_as_its_dequantisation(
        arch, gguf_arch, tmp_path, monkeypatch):
    from batchrun.models.arch import native
    from batchrun.models.quant.experts import QuantizedExperts
    from tests.tiny_models import BACKEND_ARCHS

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    hf = make_tiny(arch, tmp_path, archs=BACKEND_ARCHS)
    gguf_path = tmp_path / "tiny.gguf"
    # gate and up in different families: each expert's fused gate+up is a StackedLinear
    _write_arch_gguf(hf, gguf_path, gguf_arch, {"attn_k": Q.Q8_0, "ffn_gate_exps": Q.Q4_0,
                                                "ffn_up_exps": Q.Q8_0, "ffn_gate": Q.Q8_0})
    (tmp_path / "gguf_source.txt").write_text(str(gguf_path))
    hf_cfg = AutoConfig.from_pretrained(tmp_path)
    module = native.module_for(hf_cfg)
    cfg = module.ModelConfig.from_hf(hf_cfg)

    def engine(quantization):
        model = build_model(module.Model, cfg, tmp_path, CPU, torch.float32, quantization)
        return build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, torch.float32)

    quantized = engine("gguf")
    model = quantized.runner.model
    assert weights_bytes(cfg, "float32", quantization="gguf", gguf=gguf_path) == held_bytes(model)
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == (2 if arch == "qwen3_moe" else 0)
    assert not any(p.dim() == 3 for p in model.parameters())

    gguf = GgufLinears(gguf_path)  # the reference: float layers holding the gguf package's dequantisation
    monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    reference = engine("none")
    for i, layer in enumerate(reference.runner.model.layers):
        def dequantised(*parts):  # the gguf package's, rows as stored (these archs: the model's order)
            return torch.cat([torch.from_numpy(dequantize(raw.reshape(rows, -1), gguf.kind(name))
                                               .reshape(rows, cols).astype(np.float32))
                              for name in (f"blk.{i}.{p}.weight" for p in parts)
                              for raw, rows, cols in [gguf.raw(name)]])

        layer.self_attn.qkv_proj.weight.data.copy_(dequantised("attn_q", "attn_k", "attn_v"))
        layer.self_attn.o_proj.weight.data.copy_(dequantised("attn_output"))
        torch.testing.assert_close(model.layers[i].self_attn.qkv_proj.dequantized_weight(),
                                   layer.self_attn.qkv_proj.weight, rtol=1e-6, atol=1e-6)
        if arch == "qwen3_moe":
            e, hidden = cfg.num_experts, cfg.hidden_size
            gate, up = (dequantised(p).reshape(e, -1, hidden) for p in ("ffn_gate_exps", "ffn_up_exps"))
            layer.mlp.experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
            layer.mlp.experts.down_proj.data.copy_(dequantised("ffn_down_exps").reshape(e, hidden, -1))
            kept = model.layers[i].mlp.experts
            torch.testing.assert_close(kept.gate_up_proj[1].dequantized_weight(),
                                       layer.mlp.experts.gate_up_proj[1], rtol=1e-6, atol=1e-6)
        else:
            layer.mlp.gate_up_proj.weight.data.copy_(dequantised("ffn_gate", "ffn_up"))
            layer.mlp.down_proj.weight.data.copy_(dequantised("ffn_down"))
    _assert_decodes_as(quantized, reference, arch)
