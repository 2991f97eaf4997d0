"""The quantized layers' CUDA path (the Triton GEMMs: engine/kernels/triton_scaled_gemm.py,
triton_weight_gemm.py, triton_int4_gemm.py), forced on CPU tensors under Triton's interpreter
(on_device.FORCED; conftest sets TRITON_INTERPRET=1 without a GPU): each layer against its
reference dequantisation and against its CPU path on the same weights, a stored checkpoint and a
tiny model end to end, and which methods and formats CUDA takes or refuses."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig

pytest.importorskip("triton")

from batchrun.llm import build_model  # noqa: E402
from batchrun.models.arch.llama import LlamaModel, ModelConfig  # noqa: E402
from batchrun.models.quant import QuantizationError, check_checkpoint, method, on_device  # noqa: E402
from batchrun.models.quant.fp8_linear import Fp8Linear, Fp8WeightLinear  # noqa: E402
from batchrun.models.quant.int4_linear import Int4WeightLinear  # noqa: E402
from batchrun.models.quant.int8_linear import Int8Linear, Int8WeightLinear  # noqa: E402
from tests import quant_checkpoints as qc  # noqa: E402
from tests.tiny_models import make_tiny  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(on_device, "FORCED", True)


def _rows_to(x: torch.Tensor, step_of) -> torch.Tensor:
    """Each row rounded as dynamic per-token quantization rounds it (float64)."""
    scale = x.double().abs().amax(-1, keepdim=True).clamp(min=1e-12) / step_of
    if step_of == 127:
        return torch.round(x.double() / scale) * scale
    return (x.double() / scale).float().to(torch.float8_e4m3fn).double() * scale


def _inputs(seed: int, rows: int = 7, k: int = 192, n: int = 96):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05,
            torch.randn(n, generator=gen))


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6) -> None:
    tol = rel * float(want.abs().max()) + 1e-5
    assert float((got.double() - want.double()).abs().max()) <= tol


def test_w8a8_int8_layer_on_the_triton_path_matches_its_reference_and_cpu_path(forced):
    x, w, bias = _inputs(0)
    layer = Int8Linear(w, bias)
    assert layer.qweight is not None and not layer.onednn  # built forced: plain int8 weights
    want = _rows_to(x, 127) @ layer.dequantized_weight().double().T + bias.double()
    _close(layer(x), want)
    on_device.FORCED = False
    _close(layer(x), want, rel=1e-5)  # the CPU path's emulation of the same weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: CUDA's default
def test_smoothed_int8_layer_with_outlier_channels_matches_its_cpu_path(forced, dtype):
    x, w, bias = _inputs(1)
    x[:, 5] *= 40  # an outlier channel
    smooth = torch.rand(192, generator=torch.Generator().manual_seed(2)) + 0.5
    outliers = torch.tensor([5, 17, 90])
    triton_layer = Int8Linear(w, bias, smooth=smooth, outliers=outliers)
    on_device.FORCED = False
    cpu_layer = Int8Linear(w, bias, smooth=smooth, outliers=outliers)
    x = x.to(dtype)
    want = cpu_layer(x)
    on_device.FORCED = True
    got = triton_layer(x)
    assert got.dtype == dtype
    _close(got, want, rel=1e-5 if dtype == torch.float32 else 2.0 ** -7)


def test_a_w8a8_layer_packed_for_onednn_unpacks_its_weights_when_it_leaves_the_cpu():
    """A stored checkpoint's layers are read on the CPU (oneDNN's layout where it runs) and
    then moved to the model's device, where the Triton GEMM reads plain int8 weights."""
    x, w, bias = _inputs(7)
    layer = Int8Linear(w, bias)
    q = layer.dequantized_weight()
    layer.to("meta")
    assert not layer.onednn and layer.qweight is not None and layer.qweight.device.type == "meta"
    assert layer.w_scale.device.type == "meta" and layer.bias.device.type == "meta"
    assert q.shape == layer.qweight.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_layer_on_the_triton_path_is_its_dequantised_weights(forced, dtype):
    x, w, bias = _inputs(3)
    layer = Int8WeightLinear(w, bias)
    xd = x.to(dtype)
    want = xd.double() @ layer.dequantized_weight().to(dtype).double().T + bias.double()
    got = layer(xd)
    assert got.dtype == dtype
    _close(got, want, rel=2e-6 if dtype == torch.float32 else 2.0 ** -6)


@pytest.mark.parametrize("block", [(1, 200), (32, 64)])  # per channel, and blocks not dividing K
def test_fp8_checkpoint_layer_on_the_triton_path_is_its_reference_dequantisation(forced, block):
    gen = np.random.default_rng(4)
    w = gen.standard_normal((96, 200)).astype(np.float32)
    stored, reference = qc.fp8(w, block, "weight_scale")
    from batchrun.models.quant.fp8_linear import fp8_layer

    read = fp8_layer(torch.from_numpy(stored["weight"]) if isinstance(stored["weight"], np.ndarray)
                     else stored["weight"], torch.as_tensor(stored["weight_scale"]), block)
    layer = read.make(bias=None, **read.rows, **read.options)
    assert type(layer) is Fp8WeightLinear
    x = torch.randn(6, 200)
    _close(layer(x), x.double() @ torch.from_numpy(reference).double().T)


def test_fp8_w8a8_layer_matches_its_reference_on_both_paths(forced):
    x, w, bias = _inputs(5)
    layer = Fp8Linear(w, bias)
    assert layer.fp8.dtype == torch.float8_e4m3fn
    want = _rows_to(x, 448) @ layer.dequantized_weight().double().T + bias.double()
    _close(layer(x), want)
    on_device.FORCED = False
    _close(layer(x), want)
    assert float((want - (x.double() @ w.double().T + bias.double())).abs().max()) < 0.1


def test_int4_weight_layer_on_the_triton_path_is_its_dequantised_weights(forced):
    x, w, bias = _inputs(6, n=128)
    layer = Int4WeightLinear(w, bias)
    _close(layer(x), x.double() @ layer.dequantized_weight().double().T + bias.double())


def test_cuda_takes_the_wired_methods_and_formats_and_refuses_the_rest():
    cuda = torch.device("cuda")
    for name in ("int8", "int8-weight", "int4-weight", "fp8", "none"):
        method(name).check_device(cuda)
    for name in ("gguf", "bf16"):
        with pytest.raises(QuantizationError, match=f"'{name}' runs on the CPU only .*int8, "
                                                    "int8-weight, int4-weight, fp8"):
            method(name).check_device(cuda)
    with pytest.raises(QuantizationError, match="'fp8' runs on the CPU only"):
        method("fp8").check_device(torch.device("mps"))
    with pytest.raises(QuantizationError, match="int8 on the transformers backend runs on the CPU"):
        method("int8").check_device(cuda, backend=True)
    method("int8").check_device(CPU, backend=True)
    cfg = type("Cfg", (), {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                   "group_size": 32, "version": "gemm"}})
    assert check_checkpoint(cfg, cuda).method == "awq"
    mx = type("Cfg", (), {"quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(QuantizationError, match="mxfp4 checkpoint's quantized layers run on the "
                                                "CPU only .*CUDA runs gptq, awq"):
        check_checkpoint(mx, cuda)


def _hidden(path, quantization: str) -> torch.Tensor:
    from batchrun.models.quant.calibration import window_forward

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(LlamaModel, cfg, path, CPU, torch.float32, quantization)
    return window_forward(model, [5, 9, 200, 31, 7, 44, 3])[0]


@pytest.mark.parametrize("quantization", ["int8", "int8-weight", "int4-weight", "fp8"])
def test_a_tiny_model_quantized_on_the_triton_path_computes_as_its_cpu_path(
        quantization, tmp_path, monkeypatch):
    """The same model quantized at load, its linears forced through the Triton GEMMs, against
    its CPU path: the same hidden states (int8: the same calibration, smoothing and outliers)."""
    from tests.tiny_models import calibrate_int8_on_random_tokens

    calibrate_int8_on_random_tokens(monkeypatch)
    make_tiny("llama", tmp_path)
    want = _hidden(tmp_path, quantization)
    monkeypatch.setattr(on_device, "FORCED", True)
    got = _hidden(tmp_path, quantization)
    _close(got, want, rel=1e-4)


def _stored_decodes_as_transformers(case: str, tmp_path, device: torch.device) -> None:
    from batchrun.llm import build_engine
    from batchrun.options.engine import EngineConfig
    from tests.tiny_models import IdTokenizer
    from tests.unit import test_quant_checkpoints as stored

    config, pack, cls = stored.CASES[case]
    hf = make_tiny("qwen2" if case == "awq-g32" else "llama", tmp_path)
    if case == "awq-g32":  # q/k/v biases beside the quantized weights
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
        hf.save_pretrained(tmp_path)
    reference = qc.quantize_checkpoint(tmp_path, pack, config)
    model = build_model(LlamaModel, ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path)),
                        tmp_path, device, torch.float32)
    engine = build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2], device,
                          torch.float32)
    layer = model.layers[0].mlp.down_proj
    assert type(layer) is cls and getattr(layer, "onednn", False) is False
    for prefix, weight in reference.items():
        linear = hf.get_submodule(prefix)
        linear.weight.data = torch.from_numpy(weight)
        if cls is Int8Linear:
            linear.register_forward_pre_hook(lambda m, args: (stored._fake_quant_rows(args[0]),))
    stored._assert_decodes_as(engine, hf, f"{case} on {device}")


@pytest.mark.parametrize("case", ["awq-g32", "ct-w8a8", "fp8-block"])
def test_a_stored_checkpoint_on_the_triton_path_decodes_as_transformers(case, tmp_path, monkeypatch):
    """A GPTQ/AWQ-style int4, a W8A8 int8 and a block-scaled FP8 checkpoint, their layers forced
    through the Triton GEMMs, decode greedily as transformers on the format's dequantised weights
    (the CPU path's test: tests/unit/test_quant_checkpoints.py)."""
    monkeypatch.setattr(on_device, "FORCED", True)
    _stored_decodes_as_transformers(case, tmp_path, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["gptq-act-order-g32", "awq-g32", "ct-w8a8", "fp8-block"])
def test_a_stored_checkpoint_on_cuda_decodes_as_transformers(case, tmp_path):
    """The same on a GPU: the layers read on the CPU, moved to CUDA, the kernels compiled."""
    _stored_decodes_as_transformers(case, tmp_path, torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", ["int8", "int8-weight", "int4-weight", "fp8"])
def test_a_model_quantized_on_cuda_computes_as_on_the_cpu(quantization, tmp_path, monkeypatch):
    from tests.tiny_models import calibrate_int8_on_random_tokens

    calibrate_int8_on_random_tokens(monkeypatch)
    make_tiny("llama", tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    from batchrun.models.quant.calibration import window_forward

    ids = [5, 9, 200, 31, 7, 44, 3]
    want = window_forward(build_model(LlamaModel, cfg, tmp_path, CPU, torch.float32, quantization), ids)[0]
    model = build_model(LlamaModel, cfg, tmp_path, torch.device("cuda"), torch.float32, quantization)
    _close(window_forward(model, ids)[0].cpu(), want, rel=1e-3)


def test_a_checkpoint_with_quantized_experts_is_refused_off_the_cpu(tmp_path):
    """Its dense projections follow the model to its device; its routed experts (one layer call
    per expert, a host sync per step) are refused there by name. (The meta device stands in for
    CUDA: the check is by device, and nothing computes.)"""
    from batchrun.models.arch import native
    from batchrun.models.quant import CheckpointFormat
    from tests.tiny_models import BACKEND_ARCHS
    from tests.unit.test_quant_checkpoints import CASES

    config, pack, _ = CASES["fp8-block"]
    make_tiny("qwen3_moe", tmp_path, archs=BACKEND_ARCHS)
    qc.quantize_checkpoint(tmp_path, pack, config)
    hf_cfg = AutoConfig.from_pretrained(tmp_path)
    module = native.module_for(hf_cfg)
    with torch.device("meta"):
        model = module.Model(module.ModelConfig.from_hf(hf_cfg))
    with pytest.raises(QuantizationError, match="routed experts are kept quantized on the CPU "
                                                "only .*on meta"):
        CheckpointFormat("fp8", config).load_linears(model, tmp_path)
    assert type(model.layers[0].self_attn.qkv_proj) is Fp8WeightLinear
    assert model.layers[0].self_attn.qkv_proj.fp8.device.type == "meta"


def test_int4_weights_quantized_off_the_cpu_keep_the_plain_nibble_layout():
    """torch's CPU int4 packing is CPU-only: a layer quantized on another device (CUDA; meta
    here) packs two inputs a byte, which the Triton int4 GEMM reads as well."""
    layer = Int4WeightLinear(torch.randn(128, 64, device="meta"), None)
    assert not layer.kernel_layout and layer.packed.device.type == "meta"
    assert tuple(layer.packed.shape) == (128, 32)
