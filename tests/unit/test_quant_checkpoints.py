"""Checkpoints stored quantized (GPTQ, AWQ, compressed-tensors, FP8) loaded in their own format
(models/quant/checkpoint.py and a file per format): per layer against the format's reference
dequantisation (written in tests/quant_checkpoints.py; the compressed-tensors package's
decompressor for its formats), end to end on a tiny Llama against transformers on the
dequantised weights, and the refusals."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from batchrun.engine import SamplingParams
from batchrun.footprint import model_config_for, weights_bytes
from batchrun.llm import build_engine, build_model
from batchrun.models.arch.llama import LlamaModel, ModelConfig
from batchrun.models.quant import QuantizationError, check_checkpoint, cpu
from batchrun.models.quant.checkpoint import Tensors
from batchrun.models.quant.fp8_linear import Fp8WeightLinear
from batchrun.models.quant.int4_linear import Int4WeightLinear
from batchrun.models.quant.int8_linear import Int8Linear
from batchrun.options.engine import EngineConfig
from tests import quant_checkpoints as qc
from tests.helpers import held_bytes
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import IdTokenizer, make_tiny

CPU = torch.device("cpu")


def _ct(fmt, weights, acts=None):
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# name: (quantization_config, packing of one float weight, the layer it loads as)
CASES = {
    "gptq-sym-g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True,
                      "desc_act": False}, lambda w: qc.gptq(w, 64, sym=True, v2=False), Int4WeightLinear),
    "gptq_v2-asym-channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False,
                              "desc_act": False, "checkpoint_format": "gptq_v2"},
                             lambda w: qc.gptq(w, -1, sym=False, v2=True), Int4WeightLinear),
    "gptq-act-order-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                            "desc_act": True}, lambda w: qc.gptq(w, 32, sym=False, v2=False, act_order=True),
                           Int4WeightLinear),
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                 "version": "gemm"}, lambda w: qc.awq(w, 32), Int4WeightLinear),
    "ct-w4a16-asym": (_ct("pack-quantized", {**INT4, "symmetric": False}),
                      lambda w: qc.ct_int4(w, 32, sym=False), Int4WeightLinear),
    "ct-w4a16-sym": (_ct("pack-quantized", {**INT4, "symmetric": True}),
                     lambda w: qc.ct_int4(w, 32, sym=True), Int4WeightLinear),
    "ct-w4a16-act-order": (_ct("pack-quantized", {**INT4, "symmetric": False, "actorder": "group"}),
                           lambda w: qc.ct_int4(w, 32, sym=False, act_order=True), Int4WeightLinear),
    "ct-w4a16-weight-order": (_ct("pack-quantized", {**INT4, "symmetric": True, "actorder": "weight"}),
                              lambda w: qc.ct_int4(w, 32, sym=True), Int4WeightLinear),
    "ct-w8a8": (_ct("int-quantized", INT8, TOKEN_INT8), qc.ct_int8, Int8Linear),
    "ct-fp8-channel": (_ct("float-quantized", FP8_CHANNEL),
                       lambda w: qc.fp8(w, (1, w.shape[1]), "weight_scale"), Fp8WeightLinear),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  lambda w: qc.fp8(w, (128, 128), "weight_scale_inv"), Fp8WeightLinear),
}


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """W8A8's dynamic activations: each row rounded to int8 steps of max|row| / 127."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / scale) * scale


def _package_reference(config, stored):
    """The compressed-tensors package's own decompression of one layer's tensors."""
    from compressed_tensors.compressors.naive_quantized.base import (FloatQuantizationCompressor,
                                                                      IntQuantizationCompressor)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=group["weights"],
                                input_activations=group["input_activations"])
    compressor = {"pack-quantized": PackedQuantizationCompressor, "int-quantized": IntQuantizationCompressor,
                  "float-quantized": FloatQuantizationCompressor}[config["format"]]
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in stored.items()}
    return compressor.decompress(tensors, scheme)["weight"].float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_layer_reads_as_its_formats_reference_dequantisation(case, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)  # float32 compute even so
    config, pack, cls = CASES[case]
    w = np.random.default_rng(1).standard_normal((128, 256)).astype(np.float32)
    stored, reference = pack(w)
    from safetensors.torch import save_file

    save_file({f"layer.{k}": v if isinstance(v, torch.Tensor) else torch.from_numpy(v)
               for k, v in stored.items()}, tmp_path / "model.safetensors")
    fmt = check_checkpoint(type("Cfg", (), {"quantization_config": config}))
    read = fmt.module.read(Tensors(tmp_path), "layer", config)
    layer = read.make(bias=None, **read.rows, **read.options)
    assert type(layer) is cls
    np.testing.assert_allclose(layer.dequantized_weight().numpy(), reference, rtol=0, atol=0)
    if config["quant_method"] == "compressed-tensors" and "weight_g_idx" not in stored:
        # (the package's decompressor dropped g_idx with "group" ordering; the reference there
        # is vLLM's reading, w[n, k] = scale[n, g_idx[k]] * (q[n, k] - zero[n, g_idx[k]]))
        np.testing.assert_allclose(reference, _package_reference(config, stored), rtol=1e-6, atol=0)
    assert np.abs(reference - w).max() < 0.25 * np.abs(w).max()  # a quantization of w, not noise
    x = torch.randn(5, 256)
    expected = (_fake_quant_rows(x) if cls is Int8Linear else x) @ torch.from_numpy(reference).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def _engine(path):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(LlamaModel, cfg, path, CPU, torch.float32)
    return build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, torch.float32)


def _assert_decodes_as(engine, hf, label: str) -> None:
    """Greedy decoding of three random prompts matches transformers' (tie rule: tests/parity.py)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    report = ParityReport()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert_greedy_match(out.outputs[0].token_ids, ref.sequences[0, len(prompt):].tolist(),
                            [lg[0] for lg in ref.logits], f"{label}[{i}]", report)
    assert report.compared == 3


@pytest.mark.parametrize("case", ["gptq-sym-g64", "gptq-act-order-g32", "awq-g32", "ct-w4a16-asym",
                                  "ct-w4a16-act-order",
                                  "ct-w8a8", "fp8-block"])  # the other cases' layers: per layer above
def test_a_quantized_checkpoint_decodes_as_transformers_on_its_dequantised_weights(case, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)  # float32 compute even so
    config, pack, cls = CASES[case]
    hf = make_tiny("qwen2" if case == "awq-g32" else "llama", tmp_path)
    if case == "awq-g32":  # Qwen2's q/k/v biases, stored beside the quantized weights
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
        hf.save_pretrained(tmp_path)
    reference = qc.quantize_checkpoint(tmp_path, pack, config)
    engine = _engine(tmp_path)
    model = engine.runner.model
    for layer in model.layers:
        assert all(type(m) is cls for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert weights_bytes(ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path)), "float32") == \
        held_bytes(model)

    for prefix, weight in reference.items():  # transformers on the format's dequantised weights
        linear = hf.get_submodule(prefix)
        linear.weight.data = torch.from_numpy(weight)
        if cls is Int8Linear:
            linear.register_forward_pre_hook(lambda m, args: (_fake_quant_rows(args[0]),))
    _assert_decodes_as(engine, hf, case)


def _config(quantization_config):
    return type("Cfg", (), {"quantization_config": quantization_config})


@pytest.mark.parametrize("config, reason", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized with 'bitsandbytes'"),
    (_ct("pack-quantized", {**INT4, "symmetric": True}, TOKEN_INT8), "compressed-tensors 4-bit int"),
    (_ct("nvfp4-pack-quantized", {"num_bits": 4, "type": "float"}), "nvfp4-pack-quantized"),
    ({**_ct("int-quantized", INT8, TOKEN_INT8), "sparsity_config": {"format": "sparse-24"}}, "sparse"),
    (_ct("int-quantized", {**INT8, "actorder": "group"}, TOKEN_INT8), "act-order 'group' on 8-bit int"),
])
def test_a_variant_batchrun_cannot_run_is_refused_naming_it(config, reason):
    with pytest.raises(QuantizationError, match=reason):
        check_checkpoint(_config(config))


def test_other_devices_and_batch_invariance_on_a_quantized_checkpoint_are_refused(tmp_path):
    config = CASES["awq-g32"][0]
    check_checkpoint(_config(config), torch.device("cuda"))  # the Triton int4 GEMM runs it
    with pytest.raises(QuantizationError, match="awq checkpoint's quantized layers run on the CPU only"):
        check_checkpoint(_config(config), torch.device("mps"))
    make_tiny("llama", tmp_path)
    qc.quantize_checkpoint(tmp_path, CASES["awq-g32"][1], config)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    with pytest.raises(QuantizationError, match=r"--batch-invariant does not cover .*\(awq int4"):
        build_model(LlamaModel, cfg, tmp_path, CPU, torch.float32, batch_invariant=True)


def test_fp8_requantized_to_int8_weight_stays_within_half_a_step(tmp_path):
    from batchrun.models.quant.int8_linear import Int8WeightLinear

    config, pack, _ = CASES["fp8-block"]
    make_tiny("llama", tmp_path)
    reference = qc.quantize_checkpoint(tmp_path, pack, config)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    model = build_model(LlamaModel, cfg, tmp_path, CPU, torch.float32, "int8-weight")
    assert weights_bytes(cfg, "float32", quantization="int8-weight") == held_bytes(model)
    down = model.layers[1].mlp.down_proj
    assert isinstance(down, Int8WeightLinear)
    fp8 = reference["model.layers.1.mlp.down_proj"]
    step = down.w_scale[:, None].numpy()
    assert (np.abs(down.dequantized_weight().numpy() - fp8) <= step / 2 + 1e-7).all()


def test_a_g_idx_with_unequal_groups_is_refused(tmp_path):
    config, pack, _ = CASES["gptq-sym-g64"]
    make_tiny("llama", tmp_path)

    def unequal(w):
        tensors, reference = pack(w)
        tensors["g_idx"] = np.where(np.arange(len(tensors["g_idx"])) == 0, 1, tensors["g_idx"]).astype(np.int32)
        return tensors, reference

    qc.quantize_checkpoint(tmp_path, unequal, {**config, "desc_act": True})
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    with pytest.raises(QuantizationError, match="g_idx whose groups are not all 64 inputs wide"):
        build_model(LlamaModel, cfg, tmp_path, CPU, torch.float32)


def test_plan_reads_the_quantized_footprint_from_the_config(tmp_path):
    make_tiny("llama", tmp_path)
    float_bytes = weights_bytes(model_config_for(str(tmp_path)), "float32")
    qc.quantize_checkpoint(tmp_path, CASES["gptq-sym-g64"][1], CASES["gptq-sym-g64"][0])
    cfg = model_config_for(str(tmp_path))
    h, inter, layers = 128, 256, 2  # make_tiny's: q 128, k/v 64 wide; int4 + fp32 scale, min per 64
    linears = (256 * h + h * h + 2 * inter * h + h * inter) * layers
    assert weights_bytes(cfg, "float32") == float_bytes - linears * 4 + linears // 2 + linears // 64 * 8


def test_models_check_names_the_stored_format_or_why_it_is_refused(tmp_path):
    from batchrun.models.transformers.check import check, describe
    from tests.tiny_models import BACKEND_ARCHS

    make_tiny("llama", tmp_path / "dense")
    qc.quantize_checkpoint(tmp_path / "dense", CASES["ct-w8a8"][1], CASES["ct-w8a8"][0])
    hf = AutoConfig.from_pretrained(tmp_path / "dense")
    lines = describe("tiny", check(hf))
    # int8 weights and float32 scales, with oneDNN's int64 zero points, or on an AMX-INT8 CPU
    # the tile kernel's int32 weight sums (quant/int8_amx.py)
    from batchrun.models.quant import int8_amx
    held = "304.0" if int8_amx.expected(hf.hidden_size) else "312.0"
    assert "stored quantized: compressed-tensors int8 weights and per-token activations (W8A8); " \
        f"its 14 linears hold {held} KiB (float32: 1.1 MiB), the rest float32; CPU only" in lines, lines
    moe = tmp_path / "moe"
    make_tiny("qwen3_moe", moe, archs=BACKEND_ARCHS)
    qc.quantize_checkpoint(moe, CASES["awq-g32"][1], CASES["awq-g32"][0])
    # 8 attention linears and 2 layers x 4 experts x (gate+up 128x128, down 128x64): int4 plus
    # a float32 scale and minimum per 32 inputs
    lines = describe("tiny-moe", check(AutoConfig.from_pretrained(moe)))
    assert "stored quantized: awq int4 (groups of 32, gemm packing); its 8 linears and 8 routed " \
        "experts hold 216.0 KiB (float32: 1.1 MiB), the rest float32; CPU only" in lines, lines
    hf.quantization_config = {"quant_method": "gptq", "bits": 2}
    report = check(hf)
    assert report.impl == "refused" and "GPTQ with 2-bit weights" in report.reason


def test_the_transformers_backend_refuses_a_quantized_checkpoint(tmp_path):
    import json

    from batchrun.llm import load_weights
    from batchrun.models.transformers.support import UnsupportedModelError
    from tests.tiny_models import BACKEND_ARCHS

    make_tiny("olmo2", tmp_path, archs=BACKEND_ARCHS)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": CASES["awq-g32"][0]}))
    with pytest.raises(UnsupportedModelError, match=r"stored quantized \(awq\); quantized checkpoints "
                                                    "load on the native path only"):
        load_weights(tmp_path, EngineConfig.default(device="cpu"), CPU, torch.float32)


@pytest.mark.parametrize("arch, case", [
    ("qwen2_moe", "gptq-act-order-g32"),  # a shared expert beside the routed ones; layer 1 dense
    ("mixtral", "awq-g32"),  # experts named w1 / w3 / w2 under block_sparse_moe
    ("qwen3_moe", "fp8-block"),
])
def test_a_quantized_moe_checkpoint_keeps_its_experts_quantized_and_decodes_as_transformers(
        arch, case, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from batchrun.models.arch import native
    from batchrun.models.quant.experts import QuantizedExperts
    from tests.tiny_models import BACKEND_ARCHS

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    config, pack, cls = CASES[case]
    make_tiny(arch, tmp_path / "q", archs=BACKEND_ARCHS)
    reference = qc.quantize_checkpoint(tmp_path / "q", pack, config)
    qc.dequantised_copy(tmp_path / "q", reference, tmp_path / "ref")
    hf_cfg = AutoConfig.from_pretrained(tmp_path / "q")
    module = native.module_for(hf_cfg)
    cfg = module.ModelConfig.from_hf(hf_cfg)
    model = build_model(module.Model, cfg, tmp_path / "q", CPU, torch.float32)
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == sum(cfg.sparse_layers) and experts
    for block in experts:  # every expert's layers in the stored format, none of them float
        assert all(type(m) is cls for m in (*block.gate_up_proj, *block.down_proj))
    assert not any(p.dim() == 3 for p in model.parameters())
    assert weights_bytes(cfg, "float32") == held_bytes(model)  # the experts at the format's size

    engine = build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    _assert_decodes_as(engine, hf, f"{arch}-{case}")


def test_experts_quantized_in_part_are_refused_naming_the_float_one(tmp_path):
    from tests.tiny_models import BACKEND_ARCHS

    config, pack, _ = CASES["awq-g32"]
    make_tiny("qwen3_moe", tmp_path, archs=BACKEND_ARCHS)

    reference = qc.quantize_checkpoint(tmp_path, pack, config)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj"
    for key in [k for k in tensors if k.startswith(name + ".")]:
        del tensors[key]
    tensors[f"{name}.weight"] = torch.from_numpy(np.ascontiguousarray(reference[name]))
    save_file(tensors, tmp_path / "model.safetensors")
    hf_cfg = AutoConfig.from_pretrained(tmp_path)
    from batchrun.models.arch import native

    module = native.module_for(hf_cfg)
    with pytest.raises(QuantizationError, match=rf"{name} is not stored quantized \(awq\) while "
                                                r"model.layers.1.mlp.experts.0.gate_proj is"):
        build_model(module.Model, module.ModelConfig.from_hf(hf_cfg), tmp_path, CPU, torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("quantization", ["int8", "int8-weight"])
def test_a_stored_checkpoint_requantized_holds_what_plan_counts(arch, quantization, tmp_path, monkeypatch):
    """Each stored layer (experts included) requantized by the method, the logits layer alone in
    bfloat16 under int8 on a fast-bfloat16 CPU (an MoE router stays float), and no calibrated
    smoothing counted for a checkpoint that is not calibrated."""
    from batchrun.models.arch import native
    from batchrun.models.quant.experts import QuantizedExperts
    from batchrun.models.quant.int8_linear import Int8WeightLinear
    from tests.tiny_models import BACKEND_ARCHS

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)
    make_tiny(arch, tmp_path, archs=BACKEND_ARCHS)
    qc.quantize_checkpoint(tmp_path, CASES["awq-g32"][1], CASES["awq-g32"][0])
    hf_cfg = AutoConfig.from_pretrained(tmp_path)
    module = native.module_for(hf_cfg)
    cfg = module.ModelConfig.from_hf(hf_cfg)
    model = build_model(module.Model, cfg, tmp_path, CPU, torch.float32, quantization)
    assert weights_bytes(cfg, "float32", quantization=quantization) == held_bytes(model)
    layer = {"int8": Int8Linear, "int8-weight": Int8WeightLinear}[quantization]
    assert type(model.layers[0].self_attn.qkv_proj) is layer
    for block in (m for m in model.modules() if isinstance(m, QuantizedExperts)):
        assert all(type(m) is layer for m in (*block.gate_up_proj, *block.down_proj))
    from batchrun.models.layers.packed_linear import PackedLinear
    from batchrun.models.quant.bf16_linear import Bf16Linear

    assert type(model.lm_head) is (Bf16Linear if quantization == "int8" else PackedLinear)
    routers = [m.gate for m in model.modules() if hasattr(m, "experts")]
    assert len(routers) == (2 if arch == "qwen3_moe" else 0)
    assert all(type(r) in (torch.nn.Linear, PackedLinear) for r in routers)  # float32 as loaded


def test_an_mxfp4_gpt_oss_checkpoint_keeps_its_experts_quantized_and_decodes_as_transformers(
        tmp_path, monkeypatch):
    """GPT-OSS as OpenAI ships it: the experts in MXFP4, everything else float. Against
    transformers on its own dequantisation of the blocks (gate and up rows interleaved there:
    reading them in the wrong order, or a nibble or scale off by one, fails the decode)."""
    from transformers import AutoModelForCausalLM

    from batchrun.models.arch import gpt_oss
    from batchrun.models.quant.experts import QuantizedExperts
    from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear
    from batchrun.models.transformers.check import check, describe
    from tests.tiny_models import BACKEND_ARCHS

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    make_tiny("gpt_oss", tmp_path / "q", archs=BACKEND_ARCHS)
    qc.mxfp4_experts(tmp_path / "q")
    qc.mxfp4_dequantised_copy(tmp_path / "q", tmp_path / "ref")
    hf_cfg = AutoConfig.from_pretrained(tmp_path / "q")
    cfg = gpt_oss.ModelConfig.from_hf(hf_cfg)
    model = build_model(gpt_oss.Model, cfg, tmp_path / "q", CPU, torch.float32)
    experts = [layer.mlp.experts for layer in model.layers]
    assert all(type(block) is QuantizedExperts for block in experts)
    assert all(type(m) is GroupedInt8Linear and m.bias is not None
               for block in experts for m in (*block.gate_up_proj, *block.down_proj))
    assert isinstance(experts[0].activation, gpt_oss.ClampedSwiGLU)
    assert not any(p.dim() == 3 for p in model.parameters())
    assert weights_bytes(cfg, "float32") == held_bytes(model)
    # 2 layers x 4 experts x (gate+up 256x128, down 128x128): a byte a weight, a float32 scale a block
    lines = describe("tiny-gpt-oss", check(hf_cfg))
    assert "stored quantized: mxfp4 (e2m1 in blocks of 32 with e8m0 scales, held as grouped " \
        "int8); its 8 routed experts hold 432.0 KiB (float32: 1.5 MiB), the rest float32; CPU " \
        "only" in lines, lines

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    ref = hf.model.layers[1].mlp.experts  # [experts, hidden, 2I], gate at even columns
    torch.testing.assert_close(experts[1].gate_up_proj[2].dequantized_weight(),
                               torch.cat((ref.gate_up_proj[2, :, 0::2], ref.gate_up_proj[2, :, 1::2]), 1).T,
                               rtol=0, atol=0)
    torch.testing.assert_close(experts[1].down_proj[3].dequantized_weight(), ref.down_proj[3].T,
                               rtol=0, atol=0)
    engine = build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], CPU, torch.float32)
    assert experts[0].down_proj[0].kernels is not None  # decode steps on the grouped int8 kernel
    _assert_decodes_as(engine, hf, "gpt-oss-mxfp4")
