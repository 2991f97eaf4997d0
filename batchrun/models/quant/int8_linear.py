"""int8 linear layers: W8A8 (int8 GEMM, int32 accumulation) and int8 weights with float
activations. Weights are symmetric per output channel: w[n] = q[n] * s[n], |q| <= 127."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.kernels.fallback_ops import (outlier_columns, outlier_pairs, pairs_matrix,
                                                  quantize_rows, quantize_rows_split, rescale_rows)
from batchrun.engine.kernels.ops import CpuKernels
from batchrun.models.quant import int8_amx
from batchrun.models.quant.on_device import DeviceTensors, runs_triton

log = logging.getLogger(__name__)
# Up to this many rows of bfloat16 activations the weight-only kernel wins; above it (and for
# float32 activations, which that kernel runs without vector code) this layer's weights are
# dequantized for one dense GEMM (measured on SmolLM2's shapes, rows 1-256).
WEIGHT_ONLY_KERNEL_ROWS = 4
GROUPED_KERNEL_ROWS = 16  # float32 rows through the C grouped kernel (as grouped_int8_linear.py)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]) with weight ~= q * s[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_(min=1e-12).div_(127.0)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


# The GEMM shapes the check runs: row counts from one decode row to a prefill chunk (oneDNN picks
# its kernel by shape: GEMV-like, VNNI and AMX-INT8 tiles each take some of these), depths from
# one 64-wide block to a 7B model's MLP width, both with ragged tails.
CHECK_ROWS = (1, 3, 67, 256)
CHECK_DEPTHS = (64, 576, 1544)
CHECK_COLUMNS = 96


@functools.lru_cache(maxsize=None)
def onednn_int8_available() -> bool:
    """oneDNN's int8 linear (torch.ops.onednn.qlinear_*) runs here and gives the int32 sums on
    every shape class the model's GEMMs take (CHECK_ROWS x CHECK_DEPTHS, extreme and random
    values, uint8 activations with zero point 128 as Int8Linear feeds it), to within float32's
    rounding of its uint8 accumulator (accumulator_rounding).

    Without VNNI (an AVX2-only CPU, or oneDNN capped at AVX2) its kernels multiply pairs into
    saturating int16 and get such sums wrong by up to millions; any other kernel that is wrong
    on this machine (an ISA path this project's machines have not run) fails the same check. The
    float emulation, exact and slower, then runs instead, and the load says so."""
    gen = torch.Generator().manual_seed(0)
    try:
        for k in CHECK_DEPTHS:
            q = torch.randint(-127, 128, (CHECK_COLUMNS, k), generator=gen, dtype=torch.int8)
            q[0], q[1] = 127, -127  # the largest sums of each sign
            packed = torch.ops.onednn.qlinear_prepack(q, None)
            scale, zero = torch.ones(CHECK_COLUMNS), torch.zeros(CHECK_COLUMNS, dtype=torch.int64)
            for m in CHECK_ROWS:
                x = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
                x[0] = 127
                exact = x.double().matmul(q.double().T)
                err = (onednn_qlinear(x, packed, scale, zero).double() - exact).abs()
                if (err > accumulator_rounding(exact, q)).any():
                    log.warning("oneDNN's int8 GEMM is inexact here (%d x %d x %d, off by up to "
                                "%.0f): int8 GEMMs run as exact float emulation instead (slower)",
                                m, k, CHECK_COLUMNS, err.max().item())
                    return False
        return True
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN int8 linear unavailable, int8 GEMMs emulated in float: %s", exc)
        return False


def accumulator_rounding(exact: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The most a correct kernel may be off the exact sums `exact` [M, N] of int8 weights `q`
    [N, K]: one float32 ulp of its uint8 accumulator, sum((x + 128) * w) = exact + 128 * sum(w).
    The AMX-INT8 path converts that accumulator to float32 before taking the zero point's share
    back out (the VNNI path does it in int32), so sums past 2**24 lose their last bit there.
    Only near-constant weight columns over thousands of inputs reach that; a saturating kernel
    is off by far more."""
    acc = (exact + 128 * q.double().sum(1)).abs().float()
    return torch.nextafter(acc, torch.tensor(float("inf"))).double() - acc.double()


def onednn_qlinear(qx: torch.Tensor, packed, w_scale: torch.Tensor,
                   w_zero: torch.Tensor) -> torch.Tensor:
    """float32 (qx @ q_w.T) * w_scale through oneDNN. qx goes in as uint8 with zero point 128
    (the same values): oneDNN has VNNI/AMX kernels for u8 x s8, while signed int8 activations
    send it to its reference kernel (`ref_int8`, 200x slower) on a CPU without AMX."""
    ux = qx.view(torch.uint8).bitwise_xor(0x80)  # two's complement byte b -> b + 128
    return onednn_qlinear_u8(ux, packed, w_scale, w_zero)


def onednn_qlinear_u8(ux: torch.Tensor, packed, w_scale: torch.Tensor,
                      w_zero: torch.Tensor) -> torch.Tensor:
    """onednn_qlinear of ux = qx + 128 as uint8 (quantize_rows(unsigned=True) writes it so)."""
    return torch.ops.onednn.qlinear_pointwise(ux, 1.0, 128, packed, w_scale, w_zero, None, 1.0, 0,
                                              torch.float32, "none", [], "")


class Int8Linear(DeviceTensors):
    """W8A8: y = (q_x @ q_w.T) * s_x * s_w (+ bias), q_x the per-token int8 activations. On CUDA
    (on_device.runs_triton) the int8 GEMM is the Triton scaled GEMM (int32 sums, rescaled and
    biased in its epilogue), the outlier channels a float32 GEMM beside it.

    smooth (per input channel, quant/smoothing.py): the GEMM runs on x / smooth against
    weight * smooth. outliers (input channel indices): those channels skip the int8 GEMM (their
    weight columns are zeroed there, their activations zeroed before the per-token scale is
    taken) and go through a bfloat16 GEMM with float32 sums beside it (LLM.int8()'s
    decomposition; AVX512-BF16 runs it at twice float32's rate). input_divided_by:
    the factors the layer's input already arrives divided by (folded into the preceding norm;
    `weight` is then already the smoothed one): LoRA adapters on this layer multiply them back."""

    DEVICE_TENSORS = ("qweight", "w_scale", "bias", "inv_smooth", "input_divided_by", "outliers",
                      "outlier_pairs", "channel_mult")

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 smooth: torch.Tensor | None = None, outliers: torch.Tensor | None = None,
                 input_divided_by: torch.Tensor | None = None, *,
                 qweight: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        super().__init__()
        device = (weight if qweight is None else qweight).device  # type: ignore[union-attr]
        self.inv_smooth = None if smooth is None else smooth.float().reciprocal().to(device)
        self.input_divided_by = input_divided_by
        self.outliers = None if outliers is None or not len(outliers) else outliers.long().to(device)
        # bfloat16 [ceil(outliers / 2), N, 2] (fallback_ops.outlier_pairs)
        self.outlier_pairs: torch.Tensor | None = None
        if qweight is None:  # quantized here, else a checkpoint's int8 weights and scales as they are
            assert weight is not None
            weight = weight.float()
            if self.outliers is not None:
                # one pass over the activations does both: 1/smooth, and zero on the outlier channels
                self.channel_mult = (torch.ones(weight.shape[1], device=device) if self.inv_smooth is None
                                     else self.inv_smooth.clone()).index_fill_(0, self.outliers, 0.0)
                self.outlier_pairs = outlier_pairs(weight[:, self.outliers].T)
                weight = weight.index_fill(1, self.outliers, 0.0)
            if smooth is not None:
                weight = weight * smooth.float().to(device)
            qweight, scale = quantize_per_channel(weight)
        assert scale is not None  # a checkpoint's qweight comes with its scales
        self.out_features, self.in_features = qweight.shape
        self.qweight: torch.Tensor | None  # None once oneDNN holds the packed copy
        self.qweight, self.w_scale = qweight.contiguous(), scale.float().reshape(-1).contiguous()
        self.bias = None if bias is None else bias.detach().float().to(device)
        self.onednn = not runs_triton(device) and onednn_int8_available()
        self.kernels = None  # the CPU kernel library, once built (attach_kernels)
        # The weights in the AMX kernel's layout (int8_amx.py) with their sums, or in oneDNN's
        # blocked int8 layout; either replaces the plain copy.
        self.amx_packed: torch.Tensor | None = None
        self.wsum: torch.Tensor | None = None  # int32 [N]: each output's sum of its weights
        if self.onednn and int8_amx.expected(self.in_features):
            self.amx_packed = int8_amx.pack(self.qweight)
            self.wsum = self.qweight.sum(dim=1, dtype=torch.int32)
            self.qweight = None
        elif self.onednn:
            self._pack_onednn(self.qweight)

    def _pack_onednn(self, q: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.w_zero = torch.zeros(self.out_features, dtype=torch.int64)
        self.qweight = None

    @staticmethod
    def nbytes(out_features: int, in_features: int) -> int:
        """Bytes one plain layer holds: int8 weights, float32 scales, and oneDNN's int64 zero
        points or the AMX layout's int32 weight sums (its rows padded to 16); a smoothed one's
        outlier channels: smoothquant.smoothed_bytes."""
        if not onednn_int8_available():
            return out_features * in_features + out_features * 4
        if int8_amx.expected(in_features):
            return int8_amx.held_bytes(out_features, in_features) + out_features * 4
        return out_features * in_features + out_features * 12

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*shape[:-1], self.out_features)
        if self.qweight is not None and runs_triton(x2.device):
            return self._forward_triton(x2).to(x.dtype).reshape(*shape[:-1], self.out_features)
        x_out = None
        if self.outliers is not None and self.onednn:  # one pass: gather, multiply, quantize
            qx, x_scale, x_out = quantize_rows_split(x2, self.channel_mult, self.outliers, self.kernels)
        else:
            if self.outliers is not None:
                x_out = outlier_columns(x2, self.outliers)
                x2 = x2 * self.channel_mult.to(x2.dtype)
            elif self.inv_smooth is not None:
                x2 = x2 * self.inv_smooth.to(x2.dtype)
            qx, x_scale = quantize_rows(x2, self.kernels, unsigned=self.onednn)
        if self.onednn:
            y = self.kernel_gemm(qx)
        else:  # exact while the int32 sums stay below 2**24 (float32's integers); relative 6e-8 above
            assert self.qweight is not None  # kept without oneDNN
            y = (qx.float() @ self.qweight.float().T) * self.w_scale
        rescale_rows(y, x_scale, self.bias, self.kernels, x_out, self.outlier_pairs)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def kernel_gemm(self, qx: torch.Tensor) -> torch.Tensor:
        """float32 (qx - 128) . q^T * w_scale for uint8 activations qx: the AMX kernel where the
        layer holds its layout (repacked for oneDNN the first time the library turns out to
        have no tiles), else oneDNN's int8 linear."""
        if self.amx_packed is not None:
            if self.kernels is None:  # a load-time check before the library is attached
                sums = (qx.double() - 128) @ self.plain_weight().double().T  # exact
                return sums.float() * self.w_scale  # the kernel's one rounding
            if self.kernels.int8_amx():
                return self.kernels.int8_amx_gemm(qx, self.amx_packed, self.wsum, self.w_scale,
                                                  self.out_features)
            self._pack_onednn(self.plain_weight())
            self.amx_packed = self.wsum = None
        return onednn_qlinear_u8(qx, self.packed, self.w_scale, self.w_zero)

    def plain_weight(self) -> torch.Tensor:
        """The int8 weights [N, K] from whichever layout holds them."""
        if self.qweight is not None:
            return self.qweight
        if self.amx_packed is not None:
            return int8_amx.unpack(self.amx_packed, self.out_features, self.in_features)
        return _unpack_onednn(self)

    def _forward_triton(self, x2: torch.Tensor) -> torch.Tensor:
        """float32 [M, N] through the Triton W8A8 GEMM (the CPU path's math, on the device)."""
        from batchrun.engine.kernels.triton_scaled_gemm import quantize_rows_int8, scaled_gemm

        x_out = None
        if self.outliers is not None:
            x_out = outlier_columns(x2, self.outliers)
            x2 = x2 * self.channel_mult.to(x2.dtype)
        elif self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth.to(x2.dtype)
        assert self.qweight is not None
        qx, x_scale = quantize_rows_int8(x2)
        y = scaled_gemm(qx, self.qweight, x_scale, self.w_scale, self.bias)
        if x_out is not None:
            assert self.outlier_pairs is not None  # made with the outliers
            y.addmm_(x_out.float(), pairs_matrix(self.outlier_pairs))
        return y

    def _apply(self, fn, recurse=True):
        """Off the CPU, the int8 weights come back out of oneDNN's layout (the Triton GEMM's)."""
        if self.onednn and fn(torch.empty(0)).device.type != "cpu":
            self.qweight, self.onednn = self.plain_weight(), False
            self.amx_packed = self.wsum = self.packed = self.w_zero = None
        return super()._apply(fn, recurse)

    def dequantized_weight(self) -> torch.Tensor:
        """The weights this layer's GEMMs compute with, in the input's own scale."""
        q = self.plain_weight()
        w = q.float() * self.w_scale[:, None]
        if self.inv_smooth is not None:
            w = w * self.inv_smooth
        if self.outliers is not None:
            assert self.outlier_pairs is not None  # made with the outliers
            w[:, self.outliers] = pairs_matrix(self.outlier_pairs)[:len(self.outliers)].T
        return w


def attach_kernels(model: nn.Module, kernels) -> None:
    """Give the model's W8A8, int8-weight and grouped-int8 layers the CPU kernel library (built beside the
    weights' loading)."""
    from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear

    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8WeightLinear, GroupedInt8Linear)):
            module.kernels = kernels


def _unpack_onednn(layer: Int8Linear) -> torch.Tensor:
    """The int8 weights back from oneDNN's layout: the GEMM of the identity (exact)."""
    eye = torch.eye(layer.in_features, dtype=torch.int8)
    y = onednn_qlinear(eye, layer.packed, torch.ones(layer.out_features), layer.w_zero)
    return y.T.round().to(torch.int8)


class Int8WeightLinear(DeviceTensors):
    """int8 weights, float activations, computed in the activations' dtype (float32: exact to
    the dequantised weights): decode rows by a weight-only kernel (torch's for a few bfloat16
    rows; the C grouped kernel, one group a row, for float32), memory-bound, reading a byte a
    weight; larger steps dequantize the layer for one dense GEMM. On CUDA every step is the
    Triton weight-only GEMM (engine/kernels/triton_weight_gemm.py), dequantising in-kernel."""

    DEVICE_TENSORS = ("qweight", "w_scale", "bias")

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 qweight: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        super().__init__()
        if qweight is None:
            assert weight is not None  # quantized here, else a checkpoint's qweight and scales
            qweight, scale = quantize_per_channel(weight)
        assert scale is not None
        self.out_features, self.in_features = weight.shape if weight is not None else qweight.shape
        self.qweight, self.w_scale = qweight.contiguous(), scale.float()
        self.bias = None if bias is None else bias.detach().float()
        self._scales: dict[torch.dtype, torch.Tensor] = {}
        self.kernels: CpuKernels | None = None  # the CPU kernel library, once built (attach_kernels)

    @staticmethod
    def nbytes(out_features: int, in_features: int) -> int:
        return out_features * in_features + out_features * 4  # int8 weights, float32 scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        dtype = x.dtype
        if runs_triton(x2.device):
            from batchrun.engine.kernels.triton_weight_gemm import weight_gemm

            y = weight_gemm(x2, self.qweight, self.w_scale[:, None], self.in_features)
        elif dtype == torch.bfloat16 and 0 < x2.shape[0] <= WEIGHT_ONLY_KERNEL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self._scale(dtype))
        elif (self.kernels is not None and dtype == torch.float32
              and 0 < x2.shape[0] <= GROUPED_KERNEL_ROWS and self.in_features % 16 == 0):
            y = self.kernels.grouped_int8_linear(x2, self.qweight, self.w_scale[:, None].contiguous(),
                                                 None, self.in_features)
        else:
            y = F.linear(x2, self.qweight.to(dtype) * self._scale(dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def moved(self) -> None:
        self._scales = {}

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scales:
            self._scales[dtype] = self.w_scale.to(dtype)
        return self._scales[dtype]

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.w_scale[:, None]
