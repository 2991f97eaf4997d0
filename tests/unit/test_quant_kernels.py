"""The W8A8 activation kernels (engine/kernels/quantize.c) against the PyTorch ops they replace,
on every vector path of the build."""

import pytest
import torch

from batchrun.engine import kernels
from batchrun.models.quant.activations import quantize_rows, rescale_rows

pytestmark = pytest.mark.skipif(kernels.library(("-DNO_SPECIALISED",)) is None,
                                reason="no C compiler here")


def _lib(path):
    # without the attention kernel's specialisations: a build of a few seconds per path
    return kernels.library(kernels.VARIANTS[path] + ("-DNO_SPECIALISED",))


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("rows,cols", [(2, 576), (3, 1536), (300, 576), (2, 37)])  # 300: threaded
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


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("bias", [False, True])
def test_rescale_rows_matches_pytorch(path, bias):
    y, scale = torch.randn(300, 960), torch.rand(300, 1)
    b = torch.randn(960) if bias else None
    expected = y * scale + (b if bias else 0)
    rescale_rows(y, scale, b, _lib(path))
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
