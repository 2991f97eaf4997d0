"""The W8A8 activation kernels (engine/kernels/quantize.c) against the PyTorch ops they replace,
on every vector path of the build."""

import pytest
import torch

from batchrun.engine import kernels
from batchrun.engine.kernels.fallback_ops import (outlier_columns, outlier_pairs, pairs_matrix, quantize_rows,
                                                  quantize_rows_split, rescale_rows)

pytestmark = pytest.mark.skipif(kernels.library(("-DNO_SPECIALISED",)) is None,
                                reason="no C compiler here")


def _lib(path):
    # without the attention kernel's specialisations: a build of a few seconds per path;
    # no-bf16: this CPU's vector path without AVX512-BF16's dot product (widened pairs and FMAs)
    flags = ("-mno-avx512bf16",) if path == "no-bf16" else kernels.VARIANTS[path]
    return kernels.library(flags + ("-DNO_SPECIALISED",))


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("rows,cols", [(2, 576), (3, 1536), (300, 576), (2, 37)])
def test_quantize_rows_matches_pytorch(path, rows, cols):
    x = torch.randn(rows, cols) * 3
    x[0] = 0  # an all-zero row: scale floored, all zeros
    q, scale = quantize_rows(x, _lib(path))
    ref_q, ref_scale = quantize_rows(x)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert (q.int() - ref_q.int()).abs().max() <= 1  # x / s may round a tie the other way
    assert (q != ref_q).float().mean() < 1e-3
    assert int(q[1:].abs().amax(dim=1).min()) == 127 and not q[0].any()
    qb, scale_b = quantize_rows(x.bfloat16(), _lib(path))
    ref_qb, ref_scale_b = quantize_rows(x.bfloat16())
    torch.testing.assert_close(scale_b, ref_scale_b, rtol=1e-6, atol=0)
    assert (qb.int() - ref_qb.int()).abs().max() <= 1


@pytest.mark.parametrize("path,rows,cols", [(p, r, c) for p in ("native", "avx2", "portable")
                                             for r, c in ((3, 576), (2, 37))]
                         + [("native", 1900, 576)])  # 1900 x 576: over a million, threaded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_unsigned_matches_float64(path, rows, cols, dtype):
    """The uint8 form oneDNN takes: q + 128 with q = round(x / s) computed in float64."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols) * 3).to(dtype)
    x[0] = 0
    x[1, 5] = -x[1].float().abs().max() * 2  # the row's extreme is negative: q = -127 -> byte 1
    u, scale = quantize_rows(x, _lib(path), unsigned=True)
    assert u.dtype == torch.uint8
    x64 = x.double()
    ref_scale = x64.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    exact = x64 / ref_scale
    ref_u = torch.round(exact) + 128
    # float32's x / s may round a value at (or within float32's error of) a tie the other way
    at_tie = (exact.abs().remainder(1) - 0.5).abs() < 1e-4
    assert (u.double() - ref_u).abs().max() <= 1 and not ((u.double() != ref_u) & ~at_tie).any()
    assert int(u[1, 5]) == 1 and (u[0] == 128).all()
    assert torch.equal(u, quantize_rows(x, _lib(path))[0].view(torch.uint8) ^ 0x80)


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("bias", [False, True])
def test_rescale_rows_matches_pytorch(path, bias):
    y, scale = torch.randn(1100, 960), torch.rand(1100, 1)  # threaded
    b = torch.randn(960) if bias else None
    expected = y * scale + (b if bias else 0)
    rescale_rows(y, scale, b, _lib(path))
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["native", "no-bf16", "avx2", "portable"])
@pytest.mark.parametrize("rows,cols,n_out", [(7, 1000, 32), (5, 40, 7), (1100, 960, 32)])  # 4-row blocks, tails, an odd count; threaded
def test_rescale_rows_with_outliers_matches_float64(path, rows, cols, n_out):
    """A smoothed Int8Linear's epilogue: y * scale + bias + the outlier channels' bfloat16 GEMM
    (x and weights rounded to bfloat16, the products summed in float32) in one pass."""
    g = torch.Generator().manual_seed(3)
    y, scale, b = torch.randn(rows, cols, generator=g), torch.rand(rows, 1, generator=g), torch.randn(cols, generator=g)
    x, part = torch.randn(rows, 40, generator=g) * 30, torch.randn(n_out, cols, generator=g)
    outliers = torch.arange(0, 40, 40 // n_out)[:n_out]
    xo, pairs = outlier_columns(x, outliers), outlier_pairs(part)
    assert xo.shape == (rows, n_out + n_out % 2) and pairs.shape == ((n_out + 1) // 2, cols, 2)
    rounded_x, rounded_w = x[:, outliers].bfloat16().double(), part.bfloat16().double()
    expected = y.double() * scale.double() + b.double() + rounded_x @ rounded_w
    rescale_rows(y, scale, b, _lib(path), xo, pairs)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(pairs_matrix(pairs)[:n_out].double(), rounded_w, rtol=0, atol=0)


@pytest.mark.parametrize("path,rows", [(p, 3) for p in ("native", "avx2", "portable")]
                         + [("native", 1900)])  # 1900 x 576: threaded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outliers", [[0, 7, 300, 575], [0, 7, 300]])  # odd: a zero pads the pair
def test_quantize_rows_split_matches_float64(path, rows, dtype, outliers):
    """A smoothed Int8Linear's input pass: the outlier columns of x in bfloat16, then x * mult
    quantized as quantize_rows(unsigned=True) would (q + 128, q = round(x * mult / s))."""
    torch.manual_seed(rows)
    cols = 576
    x = (torch.randn(rows, cols) * 3).to(dtype)
    outliers = torch.tensor(outliers)
    x[:, outliers] *= 50  # the outliers dwarf the rest, as they do in the model
    mult = (torch.rand(cols) + 0.5).index_fill_(0, outliers, 0.0)
    u, scale, x_out = quantize_rows_split(x, mult, outliers, _lib(path))
    assert torch.equal(x_out[:, :len(outliers)], x.float()[:, outliers].bfloat16())  # to nearest even, as torch
    assert x_out.shape[1] == len(outliers) + len(outliers) % 2 and not x_out[:, len(outliers):].any()
    x64 = x.double() * mult.double()
    ref_scale = x64.abs().amax(dim=1, keepdim=True) / 127
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    exact = x64 / ref_scale
    ref_u = torch.round(exact) + 128
    at_tie = (exact.abs().remainder(1) - 0.5).abs() < 1e-4
    assert (u.double() - ref_u).abs().max() <= 1 and not ((u.double() != ref_u) & ~at_tie).any()
    assert (u[:, outliers] == 128).all()
    ref = quantize_rows_split(x, mult, outliers)  # the PyTorch ops it replaces
    assert torch.equal(ref[2], x_out) and (ref[0].int() - u.int()).abs().max() <= 1


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("group,with_min", [(32, True), (32, False), (16, False)])  # Q5_K, Q8_0, Q6_K
@pytest.mark.parametrize("rows", [1, 3, 5, 200])  # 5: a partial block of rows; 200: threaded
def test_grouped_int8_linear_matches_float64(path, group, with_min, rows):
    from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear

    n, k = 80, 512
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    layer = GroupedInt8Linear(q, torch.rand(n, k // group) / 10, torch.randn(n, k // group) / 10
                              if with_min else None, group)
    layer.kernels = _lib(path)
    w = layer.dequantized_weight(torch.float64)
    x = torch.randn(rows, k)
    bound = x.double().abs() @ w.abs().T  # float32 sums of k terms: a few ulp of this
    error = (layer.kernel_forward(x).double() - x.double() @ w.T).abs()
    assert (error <= 1e-6 * bound).all(), float((error / bound).max())
    xb = x.bfloat16()  # bfloat16 activations in, bfloat16 out (rounded once: 2**-9 of the value)
    expected = xb.double() @ w.T
    error = (layer.kernel_forward(xb).double() - expected).abs()
    assert (error <= 2 ** -8 * expected.abs() + 1e-6 * bound).all()
