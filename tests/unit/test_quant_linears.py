"""Quantized linear layers (models/quant/) against float64 references of their own dequantized
weights, per layer on random data, and end to end on tiny random models."""

import pytest
import torch

from batchrun.models.quant import METHODS, QuantizationError, check_checkpoint, cpu, method, quantize_linears
from batchrun.engine.kernels.fallback_ops import quantize_rows
from batchrun.models.quant.int4_linear import Int4WeightLinear, pack, quantize_groups, unpack
from batchrun.models.quant.int8_linear import Int8Linear, Int8WeightLinear, quantize_per_channel

SHAPES = [(960, 576), (100, 96)]  # SmolLM2's qkv (the int4 kernel's layout), and an odd one
ROWS = [1, 3, 40]  # the weight-only kernel's rows and the dequantized GEMM's


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _rel_err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_weights_are_within_half_a_step(shape):
    w, _ = _weights(*shape)
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_groups_are_within_half_a_step_and_pack_round_trips(shape):
    w, _ = _weights(*shape)
    q, scale, lo = quantize_groups(w)
    assert int(q.max()) <= 15
    deq = (q.float().reshape(shape[0], -1, 32) * scale[..., None] + lo[..., None]).reshape(shape)
    assert bool(((deq - w).abs().reshape(shape[0], -1, 32) <= scale[..., None] / 2 + 1e-6).all())
    packed, kernel_layout = pack(q)
    assert packed.shape == (shape[0], shape[1] // 2)
    if shape[0] % 64:  # the CPU int4 kernel's layout (where torch's AVX-512 build packs so) needs 64s
        assert not kernel_layout
    assert torch.equal(unpack(packed, kernel_layout), q)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cls", [Int8WeightLinear, Int4WeightLinear])
def test_weight_only_linear_is_a_gemm_of_its_dequantized_weights(cls, shape, rows, dtype, kernels,
                                                                monkeypatch):
    """Every path computes in the activations' dtype, whatever the CPU: float32 is exact to the
    dequantised weights (the C grouped kernel for decode rows where the library is attached),
    bfloat16 takes the weight-only kernels for a few rows and a dequantized GEMM for more."""
    from batchrun.engine import kernels as kernel_lib

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)  # no say in weight-only compute
    w, b = _weights(*shape)
    layer = cls(w, b)
    if kernels:
        layer.kernels = kernel_lib.library(("-DNO_SPECIALISED",))  # the build test_quant_gguf uses
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ layer.dequantized_weight().double().T + b.double()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    assert _rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a8_linear_is_the_int8_product_rescaled(shape, rows, dtype):
    w, b = _weights(*shape)
    layer = Int8Linear(w, b)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    qx, sx = quantize_rows(x, layer.kernels)
    assert qx.dtype == torch.int8 and int(qx.abs().max()) == 127  # every row's max maps to 127
    ref = (qx.double() * sx.double()) @ layer.dequantized_weight().double().T + b.double()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    assert _rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    # and the whole approximation stays close to the float layer
    assert _rel_err(got, x.double() @ w.double().T + b.double()) < 0.05


@pytest.mark.parametrize("rows", ROWS)
def test_bf16_linear_is_a_gemm_of_its_bf16_weights(rows):
    from batchrun.models.quant.bf16_linear import Bf16Linear

    w, b = _weights(960, 576)
    layer = Bf16Linear(w, b)
    assert torch.equal(layer.dequantized_weight(), w.bfloat16().float())
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1))
    ref = x.bfloat16().double() @ w.bfloat16().double().T + b.double()
    got = layer(x)
    assert got.dtype == torch.float32 and _rel_err(got, ref) < 1e-2  # bfloat16 output rounding


def test_leading_dims_and_empty_batches():
    w, _ = _weights(64, 32)
    from batchrun.models.quant.bf16_linear import Bf16Linear

    for cls in (Int8Linear, Int8WeightLinear, Int4WeightLinear, Bf16Linear):
        layer = cls(w, None)
        assert layer(torch.randn(2, 5, 32)).shape == (2, 5, 64)
        assert layer(torch.randn(0, 32)).shape == (0, 64)


def test_quantize_linears_keeps_the_logits_layer_in_float():
    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.proj = torch.nn.Linear(32, 64)
    model.lm_head = torch.nn.Linear(32, 100, bias=False)
    assert quantize_linears(model, method("int4-weight")) == 1
    assert isinstance(model.block.proj, Int4WeightLinear)
    assert isinstance(model.lm_head, torch.nn.Linear)


def test_unknown_method_and_non_cpu_devices_are_refused():
    with pytest.raises(QuantizationError, match="unknown quantization 'int3'"):
        method("int3")
    with pytest.raises(QuantizationError, match="'bf16' runs on the CPU only"):
        method("bf16").check_device(torch.device("cuda"))
    method("none").check_device(torch.device("cuda"))
    with pytest.raises(QuantizationError, match="no linear layer of its own"):
        method("gguf").linear_class()


def test_every_option_value_is_a_method_with_its_layer():
    """The option's choices (options/engine.py) and the methods (models/quant/methods.py) are
    the same set; each method with a layer names a class that builds and sizes one."""
    import typing

    from batchrun.options.engine import DeviceConfig

    choices = typing.get_args(DeviceConfig.model_fields["quantization"].annotation)
    assert set(choices) == set(METHODS)
    w = torch.randn(64, 64)
    for how in METHODS.values():
        if how.linear is not None:
            layer = how.linear_class()(w, None)
            assert layer(torch.randn(3, 64)).shape == (3, 64)
            assert how.linear_class().nbytes(64, 64) > 0


def test_int4_refuses_input_sizes_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4WeightLinear(torch.randn(8, 40), None)


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "eetq"])
def test_checkpoints_quantized_in_other_formats_are_refused_by_name(method):
    from types import SimpleNamespace

    with pytest.raises(QuantizationError, match=f"quantized with '{method}', which batchrun does not load"):
        check_checkpoint(SimpleNamespace(quantization_config={"quant_method": method, "bits": 4}))
    check_checkpoint(SimpleNamespace())  # a float checkpoint


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_w8a8_is_exact_under_an_isa_cap(isa):
    """oneDNN without VNNI sums int8 pairs in saturating int16: on such a CPU (here: oneDNN and
    ATen capped, as benchmarks/machine.py does) the layer must notice and stay exact."""
    import os
    import subprocess
    import sys

    from benchmarks.machine import ISA_CAPS

    code = (
        "import torch\n"
        "from batchrun.models.quant.int8_linear import Int8Linear\n"
        "w = torch.full((64, 256), 0.5); w[::2] = -0.5\n"
        "layer = Int8Linear(w, None)\n"
        "x = torch.full((3, 256), 2.0)\n"
        "ref = x.double() @ layer.dequantized_weight().double().T\n"
        "print(float((layer(x).double() - ref).abs().max() / ref.abs().max()))\n")
    env = {**os.environ, **ISA_CAPS[isa]}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert float(out.stdout) < 1e-6
