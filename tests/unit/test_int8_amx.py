"""The AMX-INT8 GEMM (engine/kernels/int8_amx.c) and Int8Linear on it: exact int32 sums, the
same float32 bits as oneDNN's int8 linear on the same weights, and the layout repacked for
oneDNN where the library turns out to have no tiles."""

import pytest
import torch

from batchrun.models.quant import int8_amx
from batchrun.models.quant.int8_linear import Int8Linear, onednn_int8_available, onednn_qlinear_u8
from tests.helpers import cpu_has, kernel_library

needs_amx = pytest.mark.skipif(not cpu_has("amx_int8") or kernel_library() is None
                               or not kernel_library().int8_amx(), reason="no AMX-INT8 here")


def test_pack_round_trips():
    q = torch.randint(-127, 128, (37, 128), dtype=torch.int8)
    assert torch.equal(int8_amx.unpack(int8_amx.pack(q), 37, 128), q)


@needs_amx
# a lone row, partial strips of 16 and 32 rows, an odd number of 16-column blocks with n past
# the last whole one, depths of one tile row to a 7B MLP's; 131 x 3072 x 576 is threaded
@pytest.mark.parametrize("rows,n,k", [(1, 37, 64), (17, 100, 128), (45, 300, 1536),
                                      (131, 3072, 576)])
def test_gemm_is_exact(rows, n, k):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0], q[-1] = 127, -127  # the largest sums of each sign
    ux = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=gen)
    ux[0] = 255
    scale = torch.rand(n, generator=gen)
    out = kernel_library().int8_amx_gemm(ux, int8_amx.pack(q), q.sum(1, dtype=torch.int32),
                                         scale, n)
    sums = (ux.long() - 128) @ q.long().T
    assert torch.equal(out, sums.float() * scale)  # the sums exact, one rounding each


@needs_amx
@pytest.mark.skipif(not onednn_int8_available(), reason="oneDNN's int8 linear does not run here")
def test_layer_gives_onednns_bits_and_falls_back_to_it():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 576, generator=gen), torch.randn(40, 576, generator=gen)
    layer = Int8Linear(w, torch.randn(200, generator=gen))
    assert layer.amx_packed is not None, "AMX-INT8 here: the layer holds the kernel's layout"
    from batchrun.engine.kernels.fallback_ops import quantize_rows
    ux, _ = quantize_rows(x, kernel_library(), unsigned=True)
    before = layer.kernel_gemm(ux)  # no library attached yet (a load-time check): exact sums
    assert layer.amx_packed is not None
    layer.kernels = kernel_library()
    q = layer.plain_weight()
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    onednn = onednn_qlinear_u8(ux, packed, layer.w_scale, torch.zeros(200, dtype=torch.int64))
    assert torch.equal(layer.kernel_gemm(ux), onednn)
    assert torch.equal(before, onednn)
    got = layer(x)
    layer.kernels = kernel_library("avx512")  # a library without the tiles: repacked for oneDNN
    assert torch.equal(layer(x), got)
    assert layer.amx_packed is None and layer.wsum is None and torch.equal(layer.plain_weight(), q)


def test_caps_below_amx_keep_onednn(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    assert not int8_amx.expected(576)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    monkeypatch.setenv("BATCHRUN_SIMD", "avx512")
    assert not int8_amx.expected(576)
    monkeypatch.delenv("BATCHRUN_SIMD")
    assert int8_amx.expected(576) == cpu_has("amx_int8")
    assert not int8_amx.expected(100)  # not whole tile rows
