"""SmoothQuant smoothing (models/quant/smoothing.py) in the W8A8 layer: the smoothed layer is the
int8 product of x / s against its own dequantized weights, it keeps the float layer's function,
and on inputs with outlier channels it is closer to the float layer than unsmoothed W8A8."""

import pytest
import torch

from batchrun.engine.kernels.fallback_ops import quantize_rows
from batchrun.models.quant.int8_linear import Int8Linear
from batchrun.models.quant.smoothing import record_input_max, smoothing_factors


def _outlier_inputs(rows, k, seed=1):
    """Activations like a residual stream's: a few channels 30x the others' scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, :: max(1, k // 4)] *= 30.0
    return x


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _rel_err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("shape", [(960, 576), (100, 96)])
@pytest.mark.parametrize("rows", [1, 40])
def test_smoothed_w8a8_is_the_int8_product_of_the_smoothed_input(shape, rows):
    w, b = _weights(*shape)
    x = _outlier_inputs(rows, shape[1])
    s = smoothing_factors(x.abs().amax(dim=0), w, alpha=0.5)
    layer = Int8Linear(w, b, smooth=s)
    qx, sx = quantize_rows(x / s, layer.kernels)
    # dequantized_weight is in the input's scale: undo its 1/s on the smoothed input
    w_smoothed = layer.dequantized_weight().double() * s.double()
    ref = (qx.double() * sx.double()) @ w_smoothed.T + b.double()
    assert _rel_err(layer(x), ref) < 1e-5
    exact = x.double() @ w.double().T + b.double()  # the float layer's own weights
    assert _rel_err(layer(x), exact) < _rel_err(Int8Linear(w, b)(x), exact)


def test_smoothing_factors_balance_activation_and_weight_ranges():
    w, _ = _weights(64, 32)
    x_max = torch.linspace(0.1, 40.0, 32)
    s = smoothing_factors(x_max, w, alpha=0.5)
    w_max = w.abs().amax(dim=0)
    # at alpha 0.5 the smoothed activation and weight column ranges are equal
    torch.testing.assert_close(x_max / s, w_max * s, rtol=1e-5, atol=0)
    assert torch.equal(smoothing_factors(x_max, w, 0.5), s)  # deterministic
    torch.testing.assert_close(smoothing_factors(x_max, w, 0.0), 1 / w_max)


def test_record_input_max_sees_every_row_and_leaves_the_output_alone():
    lin = torch.nn.Linear(8, 4)
    x1, x2 = torch.randn(3, 8), torch.randn(2, 5, 8) * 3
    with record_input_max({"lin": lin}) as stats:
        y = lin(x1)
        lin(x2)
    torch.testing.assert_close(y, x1 @ lin.weight.T + lin.bias)
    torch.testing.assert_close(stats["lin"], torch.cat([x1, x2.reshape(-1, 8)]).abs().amax(dim=0))
    lin(torch.full((1, 8), 100.0))  # hooks removed on exit
    assert float(stats["lin"].max()) < 100


def _float64_w8a8(x, w, b, s, outliers, folded=False):
    """y of the W8A8 layer with smoothing and outlier channels, in float64: x / s with the
    outlier channels zeroed, quantized per token; w * s with those columns zeroed, per output
    channel; the outlier channels' x @ w.T with both rounded to bfloat16, as the layer gets them
    (folded: x / s and w * s, else x and w)."""
    xo, wo = ((x / s, w * s) if folded else (x, w))
    xo, wo = xo[:, outliers].bfloat16().double(), wo[:, outliers].bfloat16().double()
    x, w = x.double(), w.double()
    rest = torch.ones(w.shape[1], dtype=torch.float64).index_fill_(0, outliers, 0.0)
    xs, ws = x / s.double() * rest, w * s.double() * rest
    sx = xs.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    sw = ws.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    qx, qw = torch.round(xs / sx).clamp(-127, 127), torch.round(ws / sw).clamp(-127, 127)
    return (qx * sx) @ (qw * sw).T + xo @ wo.T + b.double()


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("rows", [1, 33])
def test_smoothed_w8a8_with_outlier_channels_is_its_float64_reference(folded, rows):
    """Both forms --quantization int8 builds (smoothquant.py): 1/s applied in the layer (o_proj,
    down_proj), or already divided out upstream by the norm (qkv, gate_up: the layer gets w * s)."""
    w, b = _weights(96, 160)
    x = _outlier_inputs(rows, 160)
    s = smoothing_factors(x.abs().amax(dim=0), w, alpha=0.5)
    outliers = torch.topk(x.abs().amax(dim=0), 16).indices
    if folded:
        layer = Int8Linear(w * s, b, outliers=outliers, input_divided_by=s)
        got = layer(x / s)
    else:
        got = Int8Linear(w, b, smooth=s, outliers=outliers)(x)
    ref = _float64_w8a8(x, w, b, s, outliers, folded)
    assert _rel_err(got, ref) < 1e-5
    exact = x.double() @ w.double().T + b.double()
    assert _rel_err(got, exact) < 0.5 * _rel_err(Int8Linear(w, b)(x), exact)
