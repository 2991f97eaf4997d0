"""--dtype bfloat16 on the CPU keeps float32 where bfloat16 cost agreement with float32: the
logits GEMM's float32 output (models/layers/bf16_logits.py, engine/kernels/bf16_gemm.c) against a
float64 reference on every vector path; the same GEMM's bfloat16 output with a bias, row by row
the same bits at any row count (bf16_gemm_linear.py: every linear of a bfloat16 model on AMX); and a tiny model's prompt log-probabilities (its float32
residual stream and logits) against transformers in float64 on the same bfloat16 weights. Where
bfloat16 has no fast GEMM (oneDNN capped at AVX2) the load says so."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.models.layers.bf16_logits import Bf16LogitsLinear
from tests.helpers import cpu_has, kernel_library

pytestmark = pytest.mark.skipif(kernel_library() is None, reason="no C compiler here")


# simd.h's vector paths, and on an AMX CPU its AVX-512 path without the tiles
PATHS = ["native", *(["avx512"] if cpu_has("amx_bf16") else []), "avx2", "portable"]
# The tiles take k % 32 == 0 at any row count: partial row strips and tiles, an odd number of
# column blocks (a lone last one), n past the last whole block; 33 x 64 x 130 and 45 x 300 x 96
# are split across threads, 300 x 40 x 64 into row chunks.
SHAPES = [(1, 37, 9), (6, 100, 64), (33, 64, 130), (8, 37, 32), (17, 250, 64), (45, 300, 96),
          (300, 40, 64)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_gemm_sums_in_float32(path, rows, n, k):
    """Every output a float32 sum of the bfloat16 products (bfloat16 output, as oneDNN's GEMM
    gives through torch, is off by up to 2**-9 of the value)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = (torch.randn(rows, k, generator=gen) * 4).bfloat16()
    layer = Bf16LogitsLinear(w)
    layer.kernels = kernel_library(path)
    assert torch.equal(layer.weight_bf16(), w)  # the packed layout holds the weights exactly
    got = layer(x)
    assert got.dtype == torch.float32
    ref = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [64, 37])
def test_gemm_rows_come_out_the_same_at_any_row_count(path, k):
    """A row's bfloat16 output (bias added to the float32 sums, rounded once) is the same bits
    alone, in any slice and in the whole GEMM: what lets --batch-invariant skip fixed-size
    slices and a prefix-cache hit leave a bfloat16 answer alone. k = 37 takes the vector path
    on every CPU, 64 the tiles where there are some."""
    from batchrun.models.layers.bf16_gemm_linear import Bf16GemmLinear

    gen = torch.Generator().manual_seed(k)
    w = torch.randn(70, k, generator=gen).bfloat16()
    bias = torch.randn(70, generator=gen)
    x = (torch.randn(150, k, generator=gen) * 3).bfloat16()
    layer, sums = Bf16GemmLinear(w, bias), Bf16GemmLinear(w, None, torch.float32)
    layer.kernels = sums.kernels = kernel_library(path)
    whole = layer(x)
    assert whole.dtype == torch.bfloat16
    assert torch.equal(whole, (sums(x) + bias).bfloat16())  # one rounding, after the bias
    for start, stop in [(0, 1), (7, 8), (3, 20), (100, 150), (0, 129)]:
        assert torch.equal(layer(x[start:stop]), whole[start:stop]), (start, stop)


def test_bfloat16_linears_leave_the_kernel_only_where_it_is_not_wanted():
    """attach_all keeps the kernel's layers on an AMX library; on a library without tiles they
    become oneDNN's packed linears, unless batch invariance wants the kernel's row-invariance;
    the float32-output logits layer stays on any library."""
    from torch import nn

    from batchrun.models.layers import bf16_gemm_linear
    from batchrun.models.layers.bf16_logits import Bf16LogitsLinear
    from batchrun.models.layers.packed_linear import PackedLinear

    def model():
        m = nn.Sequential(nn.Linear(64, 32).bfloat16(), nn.Linear(32, 64, bias=False).bfloat16())
        assert bf16_gemm_linear.use_for_linears(m) == 2
        m.append(Bf16LogitsLinear(torch.randn(10, 64).bfloat16()))
        return m

    x = torch.randn(3, 64).bfloat16()
    for path, invariant in [("native", False), ("avx512", False), ("avx512", True)]:
        if path == "avx512" and not cpu_has("amx_bf16"):
            continue
        m, lib = model(), kernel_library(path)
        ref = [(layer.weight_bf16(), layer.bias) for layer in m]
        bf16_gemm_linear.attach_all(m, lib, PackedLinear, keep_without_amx=invariant)
        kept = lib.bf16_gemm_amx() or invariant
        assert [type(layer) for layer in m] == [
            *([bf16_gemm_linear.Bf16GemmLinear] * 2 if kept else [PackedLinear] * 2), Bf16LogitsLinear]
        h = x
        for layer, (w, bias) in zip(m, ref):  # the same weights, whichever layer holds them
            out = layer(h)
            expected = h.double() @ w.double().T + (0 if bias is None else bias.double())
            torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2 * float(expected.abs().max()))
            h = out.bfloat16()


def test_gemm_takes_amx_tiles_where_the_cpu_has_them():
    """On an AMX CPU (Linux 5.16+ hands the tiles out on request) the native build multiplies
    with them and the avx512 build does not; elsewhere no build does."""
    assert kernel_library().bf16_gemm_amx() == cpu_has("amx_bf16")
    if cpu_has("amx_bf16"):
        assert not kernel_library("avx512").bf16_gemm_amx()


def bf16_engine(arch, tmp_path):
    from transformers import AutoConfig

    from batchrun.llm import build_engine, build_model
    from batchrun.models.arch.llama import LlamaModel, ModelConfig
    from batchrun.options.engine import EngineConfig
    from tests.tiny_models import IdTokenizer, make_tiny

    hf = make_tiny(arch, tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    model = build_model(LlamaModel, cfg, tmp_path, torch.device("cpu"), torch.bfloat16)
    return hf, build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2],
                            torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "tied"])
def test_bfloat16_models_logits_are_float32_sums(arch, tmp_path):
    """The logits of a bfloat16 model (its own lm_head or the tied embeddings) are the float32
    sums of its bfloat16 hidden states times its bfloat16 weights."""
    hf, engine = bf16_engine(arch, tmp_path)
    model = engine.runner.model
    assert isinstance(model.lm_head, Bf16LogitsLinear)
    w = hf.get_output_embeddings().weight.detach().bfloat16()
    h = (torch.randn(7, w.shape[1], generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    got = model.compute_logits(h)
    assert got.dtype == torch.float32
    ref = h.double() @ w.double().T
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * float(ref.abs().max()))


def test_bfloat16_model_keeps_its_residual_stream_in_float32(tmp_path, monkeypatch):
    """Every block's bfloat16 output is added into a float32 stream (the fused norm kernel's
    path), and the norms hand the blocks bfloat16."""
    from batchrun.models.arch.llama import RMSNorm

    _, engine = bf16_engine("llama", tmp_path)
    seen, add_forward = [], RMSNorm.add_forward

    def recording(self, x, residual, cpu_kernels):
        out = add_forward(self, x, residual, cpu_kernels)
        seen.append((residual.dtype, out.dtype))
        return out

    monkeypatch.setattr(RMSNorm, "add_forward", recording)
    out = engine.generate([[5, 9, 30, 7]], SamplingParams(temperature=0, max_tokens=3,
                                                          ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    layers = len(engine.runner.model.layers)
    assert len(seen) == 3 * (2 * layers + 1)  # per step: two norms a layer and the final one
    assert set(seen) == {(torch.float32, torch.bfloat16)}


def test_a_cap_below_avx512_bf16_turns_fast_bf16_off(monkeypatch):
    """bench.py --isa avx2 caps oneDNN with ONEDNN_MAX_CPU_ISA: it then has no bfloat16 kernel,
    so int8's logits stay float32 and --dtype bfloat16 says what it runs."""
    from batchrun.models.quant import cpu

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu.has_fast_bf16.cache_clear()
    try:
        assert not cpu.has_fast_bf16()
        note = cpu.slow_bf16_note(torch.bfloat16, torch.device("cpu"))
        assert "widen bfloat16 to float32" in note
        assert cpu.slow_bf16_note(torch.float32, torch.device("cpu"), "bf16").startswith(
            "--quantization bf16")
        assert cpu.slow_bf16_note(torch.float32, torch.device("cpu")) is None
    finally:
        cpu.has_fast_bf16.cache_clear()
