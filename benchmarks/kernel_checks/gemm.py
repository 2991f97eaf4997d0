"""The Triton GEMM kernels (engine/kernels/triton_int4_gemm.py, triton_scaled_gemm.py,
triton_weight_gemm.py, triton_moe.py, triton_lora.py)
on small random shapes against torch reference math, on any device (the CPU runs them under
Triton's interpreter, TRITON_INTERPRET=1, which must be set before triton is imported).

CHECKS maps a kernel name to a function of the device returning (max_err, tolerance). A
reference is computed in float64 from the inputs as the kernel is documented to read them (the
int4 weights dequantised by their checkpoint format's formula from the raw nibbles, scales and
zero points, then rounded to the activations' dtype, as a weight-only GEMM multiplies them); the
tolerance is about one unit in the last place of the output dtype at the output's magnitude.
"""

from __future__ import annotations

from typing import Callable

import torch

from batchrun.engine.kernels.triton_int4_gemm import int4_gemm
from batchrun.engine.kernels.triton_lora import lora_update
from batchrun.engine.kernels.triton_weight_gemm import weight_gemm
from batchrun.engine.kernels.triton_scaled_gemm import (quantize_channels_fp8, quantize_rows_fp8,
                                                        quantize_rows_int8, scaled_gemm)
from batchrun.engine.kernels.triton_moe import grouped_gemm
from batchrun.models.layers.grouped_gemm import sort_by_expert
from batchrun.models.lora.updates import ProjectionUpdate, SliceUpdate
from batchrun.models.lora.stacked import stack_updates, stacked_segments
from batchrun.models.quant import awq, gptq
from batchrun.models.quant.int4_linear import Int4WeightLinear

# relative spacing of each dtype near the output's magnitude; bfloat16 two units: Triton 3.9's
# interpreter truncates float32 to bfloat16 (intermediates too), where a GPU rounds to nearest
_ULP = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -6}


def _tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    return _ULP[dtype] * float(ref.abs().max()) + 1e-5


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double().cpu() - ref).abs().max())


def pack_words(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words of eight 4-bit values along the last dimension: nibble i holds value order[i]."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, j in enumerate(order):
        words |= v[..., j] << (4 * i)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def int4_groups(n: int, k: int, group: int, gen: torch.Generator):
    """Random (q [N, K] in 0..15, scale float16 [N, G], zero [N, G] in 0..15)."""
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).half()
    zero = torch.randint(0, 16, (n, k // group), generator=gen)
    return q, scale, zero


def _built(layer) -> Int4WeightLinear:
    return layer.make(bias=None, **layer.rows, **layer.options)


def gptq_layer(n: int, k: int, group: int, gen: torch.Generator):
    """(an act-order GPTQ layer as batchrun reads it, its weights [N, K] in input order, float64)."""
    q, scale, zero = int4_groups(n, k, group, gen)
    zero = zero.clamp(min=1)  # the original packing stores zero - 1
    g_idx = torch.randperm(k, generator=gen) // group  # act-order: each input's group
    tensors = {"p.qweight": pack_words(q.T.reshape(k // 8, 8, n).transpose(1, 2).reshape(k // 8, 8 * n)),
               "p.qzeros": pack_words(zero.T - 1), "p.scales": scale.T.contiguous(),
               "p.g_idx": g_idx.to(torch.int32)}
    layer = _built(gptq.read(tensors, "p", {"bits": 4, "group_size": group}))  # type: ignore[arg-type]
    return layer, scale.double()[:, g_idx] * (q - zero[:, g_idx]).double()


def awq_layer(n: int, k: int, group: int, gen: torch.Generator):
    """(an AWQ (GEMM packing) layer as batchrun reads it, its weights [N, K], float64)."""
    q, scale, zero = int4_groups(n, k, group, gen)
    tensors = {"p.qweight": pack_words(q.T, awq.ORDER), "p.qzeros": pack_words(zero.T, awq.ORDER),
               "p.scales": scale.T.contiguous()}
    layer = _built(awq.read(tensors, "p", {"bits": 4, "group_size": group}))  # type: ignore[arg-type]
    cols = torch.arange(k) // group
    return layer, scale.double()[:, cols] * (q - zero[:, cols]).double()


def run_int4(layer: Int4WeightLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel on a layer's own tensors (its inputs gathered as the layer gathers them)."""
    device = x.device
    if layer.in_perm is not None:
        x = x.index_select(1, layer.in_perm.to(device))
    return int4_gemm(x, layer.packed.to(device), layer.scale.to(device), layer.minimum.to(device),
                     layer.group, layer.kernel_layout)


def _int4_check(make, n: int, rows: int, dtype: torch.dtype) -> Callable[[torch.device], tuple[float, float]]:
    def check(device: torch.device) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(n)
        layer, w = make(n, 256, 64, gen)
        x = torch.randn(rows, 256, generator=gen).to(dtype)
        ref = x.double() @ w.to(dtype).double().T
        return _err(run_int4(layer, x.to(device)), ref), _tolerance(ref, dtype)
    return check


def check_moe(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """24 tokens, top-2 of 8 experts (some left without tokens), 64 -> 96."""
    gen = torch.Generator().manual_seed(1)
    experts = torch.randint(0, 6, (24, 2), generator=gen)  # experts 6 and 7 get no rows
    experts[:, 1] = (experts[:, 0] + 1 + torch.randint(0, 5, (24,), generator=gen)) % 6
    pairs = sort_by_expert(experts, 8)
    rows = torch.randn(24, 64, generator=gen).to(dtype)[pairs.token]
    weights = torch.randn(8, 96, 64, generator=gen).to(dtype)
    ref = torch.bmm(weights[pairs.expert].double(), rows.double().unsqueeze(-1)).squeeze(-1)
    got = grouped_gemm(rows.to(device), weights.to(device), pairs.ends.to(device))
    return _err(got, ref), _tolerance(ref, dtype)


def lora_updates(gen: torch.Generator, dtype: torch.dtype) -> dict[int, ProjectionUpdate]:
    """Three adapters' updates of a fused projection 64 -> (48 | 32): slot 0 rank 4 on both
    slices, slot 2 rank 8 on the second only, slot 3 rank 16 on both."""
    def update(rank: int, slices: tuple[tuple[int, int], ...]) -> ProjectionUpdate:
        parts = [SliceUpdate(a, b, i * rank, (i + 1) * rank,
                             (torch.randn(rank, b - a, generator=gen) * 0.2).to(dtype))
                 for i, (a, b) in enumerate(slices)]
        return ProjectionUpdate(torch.randn(64, rank * len(slices), generator=gen).to(dtype), parts)
    both = ((0, 48), (48, 80))
    return {0: update(4, both), 2: update(8, ((48, 80),)), 3: update(16, both)}


LORA_SEGMENTS = [(0, 5, 3), (5, 6, 0), (8, 27, 2), (27, 30, 3)]  # rows 6, 7, 30, 31: base only


def lora_reference(x: torch.Tensor, y: torch.Tensor, updates: dict[int, ProjectionUpdate],
                   segments) -> torch.Tensor:
    """y + each segment's x @ A^T @ B^T per slice, in float64 (the shrunk rows rounded to the
    adapters' dtype, as both batchrun paths keep them)."""
    out = y.double().clone()
    for start, end, slot in segments:
        u = updates[slot]
        shrunk = (x[start:end].double() @ u.a_t.double()).to(u.a_t.dtype).double()
        for s in u.slices:
            out[start:end, s.out_start:s.out_end] += shrunk[:, s.rank_start:s.rank_end] @ s.b_t.double()
    return out


def check_lora(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(2)
    updates = lora_updates(gen, dtype)
    x = torch.randn(32, 64, generator=gen).to(dtype)
    y = torch.randn(32, 80, generator=gen).to(dtype)
    ref = lora_reference(x, y, updates, LORA_SEGMENTS)
    on_device = {slot: ProjectionUpdate(u.a_t.to(device), [SliceUpdate(
        s.out_start, s.out_end, s.rank_start, s.rank_end, s.b_t.to(device)) for s in u.slices])
        for slot, u in updates.items()}
    stacked = stack_updates(on_device, 80)
    table, max_rows = stacked_segments(LORA_SEGMENTS, stacked, device)
    got = y.to(device)
    lora_update(x.to(device), got, stacked.a_t, stacked.b_t, table, max_rows)
    return _err(got, ref), _tolerance(ref, dtype)


def _scaled_check(fp8: bool, rows: int, widen: bool | None = None
                  ) -> Callable[[torch.device], tuple[float, float]]:
    """W8A8 int8 (or float8 e4m3) 200 -> 80 with a bias: the weights quantized per channel, the
    activations per token; the reference multiplies the quantized values in float64."""
    def check(device: torch.device) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(rows)
        x, w = torch.randn(rows, 200, generator=gen), torch.randn(80, 200, generator=gen) * 0.05
        bias = torch.randn(80, generator=gen)
        quantize = quantize_rows_fp8 if fp8 else quantize_rows_int8
        (qx, sx), (qw, sw) = quantize(x), (quantize_channels_fp8(w) if fp8 else quantize_rows_int8(w))
        ref = (qx.double() @ qw.double().T) * sx.double()[:, None] * sw.double() + bias.double()
        got = scaled_gemm(qx.to(device), qw.to(device), sx.to(device), sw.to(device),
                          bias.to(device), torch.float32, widen)
        return _err(got, ref), _tolerance(ref, torch.float32)
    return check


def _weight_check(fp8: bool, rows: int, dtype: torch.dtype, group: int,
                  fp8_bits: bool | None = None) -> Callable[[torch.device], tuple[float, float]]:
    """Weight-only 200 -> 80: int8 or float8 bytes with float32 scales in groups of `group`
    inputs (the last one short where it does not divide 200), the reference's weights
    dequantised and rounded to the activations' dtype as the kernel multiplies them."""
    def check(device: torch.device) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 200, generator=gen).to(dtype)
        groups = -(-200 // group)
        scale = torch.rand(80, groups, generator=gen) * 0.01 + 0.001
        if fp8:
            # every finite e4m3 value (subnormals, both signs) and random ones
            q = (torch.randn(80, 200, generator=gen) * 100).to(torch.float8_e4m3fn)
            q.view(torch.uint8)[:2].view(-1)[:254] = torch.tensor(
                [b for b in range(256) if b & 0x7f != 0x7f], dtype=torch.uint8)
        else:
            q = torch.randint(-127, 128, (80, 200), generator=gen, dtype=torch.int8)
        w = q.double() * scale.double().repeat_interleave(group, dim=1)[:, :200]
        ref = x.double() @ w.to(dtype).double().T
        got = weight_gemm(x.to(device), q.to(device), scale.to(device), group, fp8_bits)
        return _err(got, ref), _tolerance(ref, dtype)
    return check


CHECKS: dict[str, Callable[[torch.device], tuple[float, float]]] = {
    "int4": _int4_check(gptq_layer, 96, 5, torch.bfloat16),  # GPTQ act-order, plain nibbles
    "int4_kernel_layout": _int4_check(gptq_layer, 128, 5, torch.float16),  # torch's CPU layout
    "int4_awq": _int4_check(awq_layer, 64, 20, torch.bfloat16),
    "int4_fp32": _int4_check(awq_layer, 96, 3, torch.float32),
    "w8a8_int8_gemm": _scaled_check(False, 37),
    "fp8_gemm": _scaled_check(True, 37),
    "w8a8_int8_gemm_prefill": _scaled_check(False, 130),  # 128 x 128 tiles
    "fp8_gemm_prefill": _scaled_check(True, 130),
    "fp8_gemm_widened": _scaled_check(True, 5, widen=True),  # GPUs before sm_89: bytes decoded
    "weight_int8_gemm": _weight_check(False, 9, torch.bfloat16, 200),  # int8-weight: per channel
    "weight_fp8_gemm": _weight_check(True, 9, torch.float32, 64),  # FP8 checkpoint: 1x64 blocks
    "weight_fp8_gemm_bits": _weight_check(True, 9, torch.float32, 64, fp8_bits=True),  # pre-sm_89
    "moe": check_moe,
    "lora": check_lora,
}
