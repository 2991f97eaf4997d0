"""--quantization on the transformers backend (models/transformers/quantized.py): the decoder's
linears quantized, the rest float; greedy decoding against transformers running the quantized
layers' dequantised weights (W8A8 with its activations fake-quantized per token), on tiny text
models and vision-language models with images; the footprint `plan` counts against the loaded
model's tensors."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.footprint import model_config_for, weights_bytes
from batchrun.llm import build_engine, load_from_path, load_weights
from batchrun.models.layers.packed_linear import PackedLinear
from batchrun.models.quant import calibration, cpu, smoothquant
from batchrun.models.quant.int8_linear import Int8Linear
from batchrun.models.quant.smoothing import record_input_max, smoothing_factors
from batchrun.models.transformers.processor import render
from batchrun.models.transformers.support import UnsupportedModelError
from batchrun.options.engine import EngineConfig
from tests.helpers import held_bytes
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, calibrate_int8_on_random_tokens, make_tiny
from tests.tiny_vlms import image, make_tiny_vlm
from tests.unit.test_native_model import hf_greedy
from tests.unit.test_quant_smoothing import _float64_w8a8
from tests.unit.test_vision_language import MAX_TOKENS, chat, run

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def float32_compute(monkeypatch, tmp_path):
    """Weight-only layers dequantise to float32 (as the reference runs), not bfloat16; int8
    calibrates on random tokens (a tiny model has no tokenizer) into a cache of this test's."""
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    calibrate_int8_on_random_tokens(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_dequantised(hf, model) -> int:
    """Make each linear of transformers' `hf` that the backend's `model` quantized compute as
    the quantized layer should (the same module names: the backend runs transformers' modules):
    weight-only layers with their dequantised weights; a smoothed W8A8 layer as its float64
    reference (tests/unit/test_quant_smoothing.py) from the float weights, the layer's smoothing
    factors and outlier channels. How many."""
    count = 0
    for name, module in model.hf.named_modules():
        linear = hf.get_submodule(name) if isinstance(module, Int8Linear) or \
            hasattr(module, "dequantized_weight") else None
        if isinstance(module, Int8Linear):
            assert module.inv_smooth is not None and module.outliers is not None, name
            w, b = linear.weight.detach().clone(), linear.bias
            b = torch.zeros(w.shape[0]) if b is None else b.detach().clone()
            s, outliers = module.inv_smooth.reciprocal(), module.outliers

            def w8a8(x, w=w, b=b, s=s, outliers=outliers):
                y = _float64_w8a8(x.reshape(-1, x.shape[-1]), w, b, s, outliers)
                return y.to(x.dtype).reshape(*x.shape[:-1], -1)

            linear.forward = w8a8
        elif linear is not None:
            linear.weight.data = module.dequantized_weight().float()
        count += linear is not None
    return count


# (granite under int8: a rounding of an activation to int8 steps that flips between the float64
# reference and the layer moves some logits by 1e-2, enough to break a near-tie: the layer's
# math is held to float64 in test_quant_smoothing.py)
@pytest.mark.parametrize("arch, quantization", [
    ("olmo2", "int8-weight"), ("olmo2", "int4-weight"), ("olmo2", "int8"),
    ("granite", "int8-weight"), ("granite", "int4-weight"),
    ("deepseek_v2", "int4-weight")])  # MLA attention; a dense layer, then shared + routed experts
def test_a_backend_text_model_decodes_as_transformers_on_the_dequantised_weights(arch, quantization,
                                                                                 tmp_path):
    hf = make_tiny(arch, tmp_path, archs=BACKEND_ARCHS)
    config = EngineConfig.default(model_impl="transformers", block_size=4, quantization=quantization)
    model = load_weights(tmp_path, config, CPU, torch.float32)
    # q, k, v, o, gate, up, down (DeepSeek-V2: q, kv_a, kv_b, o, and its dense MLP's or shared
    # experts' gate, up, down; the router and the routed experts' 3-D tensors stay float)
    assert _run_dequantised(hf, model) == 7 * hf.config.num_hidden_layers
    assert isinstance(model.hf.lm_head, PackedLinear)  # the logits layer stays float
    assert weights_bytes(model_config_for(str(tmp_path)), "float32", quantization=quantization) == \
        held_bytes(model)
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 19, 33)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    report = ParityReport()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, ref_logits = hf_greedy(hf, prompt, 10)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits, f"{arch}-{quantization}[{i}]", report)
    assert report.compared == 3


@pytest.mark.parametrize("family, quantization", [
    ("llava", "int4-weight"), ("qwen2_vl", "int4-weight"), ("gemma3", "int4-weight")])
def test_a_vision_language_model_quantizes_its_decoder_only_and_matches_generate(
        family, quantization, tmp_path, smol_tokenizer):
    hf, processor = make_tiny_vlm(family, tmp_path, smol_tokenizer)
    config = EngineConfig.default(block_size=4, num_blocks=256, threads=1, quantization=quantization)
    loaded = load_from_path(tmp_path, config)
    model = loaded.engine.runner.model
    decoder = model.hf.get_decoder()
    quantized = {name for name, m in model.hf.named_modules()
                 if hasattr(m, "dequantized_weight") or isinstance(m, Int8Linear)}
    assert quantized and all(name.startswith(_prefix(model.hf, decoder)) for name in quantized)
    assert _run_dequantised(hf, model) == len(quantized)
    assert weights_bytes(model_config_for(str(tmp_path)), "float32", quantization=quantization) == \
        held_bytes(model)
    cases = {"one": [image(120, 90, 1)], "none": []}
    requests = [(rid, *render(loaded.processor, chat(len(images)), images)) for rid, images in cases.items()]
    done = run(loaded.engine, requests)
    report = ParityReport()
    for rid, images in cases.items():
        ref, logits = _generate(hf, loaded.processor, chat(len(images)), images or None)
        assert_greedy_match(done[rid][0], ref, logits, f"{family} {quantization} {rid}", report)
    assert report.compared == 2


def _generate(hf, processor, messages, images):
    """tests/unit/test_vision_language.reference's greedy tokens, with the logits of each."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [lg[0] for lg in out.logits]


def _prefix(hf, decoder) -> str:
    return next(name for name, m in hf.named_modules() if m is decoder) + "."


def test_gguf_mode_on_the_backend_is_refused_with_the_reason(tmp_path):
    make_tiny("olmo2", tmp_path, archs=BACKEND_ARCHS)
    config = EngineConfig.default(model_impl="transformers", quantization="gguf")
    with pytest.raises(UnsupportedModelError, match="gguf keeps a GGUF's blocks on the native path"):
        load_weights(tmp_path, config, CPU, torch.float32)
    with pytest.raises(UnsupportedModelError, match="gguf needs the native path"):
        weights_bytes(model_config_for(str(tmp_path)), "float32", quantization="gguf")


def test_int8_on_a_vision_language_model_computes_each_layer_as_its_float64_reference(tmp_path,
                                                                                     smol_tokenizer):
    """Every decoder linear a smoothed W8A8 layer (the vision tower float), each equal to its
    float64 model on the activations an image request gave it (greedy tokens are not compared:
    on this tiny model a flipped int8 rounding early on moves later logits past any tie rule)."""
    hf, processor = make_tiny_vlm("llava", tmp_path, smol_tokenizer)
    loaded = load_from_path(tmp_path, EngineConfig.default(block_size=4, num_blocks=256, threads=1,
                                                           quantization="int8"))
    model = loaded.engine.runner.model
    layers = {name: m for name, m in model.hf.named_modules() if isinstance(m, Int8Linear)}
    assert len(layers) == 7 * hf.config.text_config.num_hidden_layers
    assert all(name.startswith(_prefix(model.hf, model.hf.get_decoder())) for name in layers)
    assert all(m.kernels is not None for m in layers.values())  # the C quantize / rescale passes
    assert weights_bytes(model_config_for(str(tmp_path)), "float32", quantization="int8") == \
        held_bytes(model)
    # each layer smoothed from its own calibrated input maxima, measured here on the float model
    with record_input_max({name: hf.get_submodule(name) for name in layers}) as maxima, torch.no_grad():
        for ids in calibration.token_windows(tmp_path):
            hf.get_decoder()(input_ids=torch.tensor([ids]), use_cache=False)
    for name, layer in layers.items():
        s = smoothing_factors(maxima[name], hf.get_submodule(name).weight.detach(), smoothquant.ALPHA)
        torch.testing.assert_close(layer.inv_smooth, s.reciprocal(), rtol=1e-5, atol=0)
    seen = {}

    def keep(name):
        def hook(module, args):  # returns None: the input goes on unchanged
            seen.setdefault(name, args[0].detach().reshape(-1, args[0].shape[-1]).clone())
        return hook

    hooks = [m.register_forward_pre_hook(keep(name)) for name, m in layers.items()]
    prompt, mm = render(loaded.processor, chat(1), [image(120, 90, 1)])
    run(loaded.engine, [("one", prompt, mm)])
    for hook in hooks:
        hook.remove()
    assert set(seen) == set(layers)
    for name, layer in layers.items():
        linear, x = hf.get_submodule(name), seen[name]
        bias = torch.zeros(linear.out_features) if linear.bias is None else linear.bias.detach()
        ref = _float64_w8a8(x, linear.weight.detach(), bias, layer.inv_smooth.reciprocal(), layer.outliers)
        with torch.no_grad():
            got = layer(x).double()
        assert float((got - ref).norm() / ref.norm()) < 1e-5, name
