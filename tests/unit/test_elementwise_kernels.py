"""The fused CPU elementwise kernels (SiLU-mul, GELU(tanh)-mul, in-place RoPE, residual add + RMSNorm) against the
PyTorch ops they replace."""

import pytest
import torch
import torch.nn.functional as F

from batchrun.models.layers.rope import RotaryEmbedding
from tests.helpers import kernel_library

pytestmark = pytest.mark.skipif(kernel_library() is None, reason="no C compiler here")
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


ACTIVATIONS = {"silu_mul": F.silu, "gelu_tanh_mul": lambda g: F.gelu(g, approximate="tanh")}


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])  # simd.h's vector paths
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows,n", [(1, 8), (3, 1536), (700, 200), (2, 37)])  # 700 x 200: threaded
@pytest.mark.parametrize("fn", list(ACTIVATIONS))
def test_activation_mul(fn, dtype, rows, n, path):
    x = (torch.randn(rows, 2 * n) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])  # exp's clamps either side
    out = getattr(kernel_library(path), fn)(x)
    # float64: float32 GELU(tanh) rounds 1 + tanh(y) to 0 in the far negative tail
    expected = (ACTIVATIONS[fn](x[:, :n].double()) * x[:, n:].double()).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("rows,n", [(1, 8), (3, 576), (700, 200), (2, 37)])  # 700 x 200: threaded
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_add_rms_norm(rows, n, add, path, dtype):
    """x, weight and out in dtype; the stream float32 (a bfloat16 model's too): the sum is exact
    float32, not x + stream rounded to bfloat16."""
    x, weight = torch.randn(rows, n).to(dtype), torch.randn(n).to(dtype)
    residual = torch.randn(rows, n) * 3
    stream = residual + x.float() if add else residual.clone()
    out = kernel_library(path).add_rms_norm(x if add else None, residual, weight, 1e-5)
    assert out.dtype == dtype
    assert torch.equal(residual, stream)  # the stream gets the add, in place
    expected = F.rms_norm(stream.double(), (n,), weight.double(), 1e-5).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
# half of 64 and 128: whole vectors on every path; of 16: AVX2's (8 lanes) but not AVX-512's;
# of 24: none
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 128), (2, 1, 16), (3, 1, 24)])
def test_rope_inplace_on_fused_qkv(dtype, H, Hkv, D, path):
    """The same bits as the reference's x * cos + rotate_half(x) * sin (products rounded before
    the sum: no FMA)."""
    T, max_pos = 300, 512
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    positions = torch.randint(0, max_pos, (T,))
    q, k, v = qkv.float().split([H * D, Hkv * D, Hkv * D], dim=-1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_ref = RotaryEmbedding.rotate(q.reshape(T, H, D), c, s).to(dtype)
    k_ref = RotaryEmbedding.rotate(k.reshape(T, Hkv, D), c, s).to(dtype)
    v_before = qkv[:, (H + Hkv) * D:].clone()

    kernel_library(path).rope_(qkv, H + Hkv, D, positions, cos, sin)
    assert torch.equal(qkv[:, :H * D].reshape(T, H, D), q_ref)
    assert torch.equal(qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D), k_ref)
    assert torch.equal(qkv[:, (H + Hkv) * D:], v_before)  # values are not rotated
