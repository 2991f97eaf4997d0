"""The Triton GEMM kernels (int4 weight-only, MoE grouped, multi-LoRA segmented) against torch
reference math and against batchrun's CPU paths on the same weights, on the CPU under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 where there is no CUDA device), or on the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchrun.engine.kernels.triton_lora import lora_update  # noqa: E402
from batchrun.engine.kernels.triton_moe import expert_tiles, grouped_gemm  # noqa: E402
from batchrun.models.arch.moe import Experts  # noqa: E402
from batchrun.models.layers.grouped_gemm import sort_by_expert  # noqa: E402
from batchrun.models.lora.layers import LoraLinear, StepAdapters  # noqa: E402
from batchrun.models.lora.stacked import stack_updates, stacked_segments  # noqa: E402
from benchmarks.kernel_checks import gemm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", sorted(gemm.CHECKS))
def test_kernel_matches_reference(name):
    max_err, tol = gemm.CHECKS[name](DEVICE)
    assert max_err <= tol, f"{name}: max error {max_err} over tolerance {tol}"


@pytest.mark.parametrize("fmt,n", [("gptq", 96), ("gptq", 128), ("awq", 64), ("awq", 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_agrees_with_cpu_layer(fmt, n, dtype):
    """The kernel on a layer's packed nibbles gives the CPU Int4WeightLinear's output (bfloat16
    few-row steps there go through torch's own int4 kernel where the nibbles are in its layout)."""
    gen = torch.Generator().manual_seed(n)
    layer, _ = (gemm.gptq_layer if fmt == "gptq" else gemm.awq_layer)(n, 128, 32, gen)
    x = torch.randn(3, 128, generator=gen).to(dtype)
    want = layer(x).double()
    got = gemm.run_int4(layer, x.to(DEVICE)).double().cpu()
    tol = (1e-5 if dtype == torch.float32 else 2.0 ** -6) * float(want.abs().max())
    assert (got - want).abs().max() <= tol


def test_int4_checks_cover_both_nibble_layouts():
    gen = torch.Generator().manual_seed(0)
    plain, _ = gemm.gptq_layer(96, 64, 32, gen)
    assert not plain.kernel_layout
    if hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        blocked, _ = gemm.gptq_layer(128, 64, 32, gen)
        assert blocked.kernel_layout


def test_int4_layer_moves_its_nibbles_by_device_only():
    """A dtype cast leaves the float32 scales as they are (the CPU path unchanged); a device move
    takes the nibbles along, which is what sends a CUDA layer to the kernel."""
    layer, _ = gemm.awq_layer(64, 64, 32, torch.Generator().manual_seed(0))
    scale = layer.scale
    layer.to(torch.bfloat16)
    assert layer.scale is scale and layer.scale.dtype == torch.float32
    layer.to("meta")
    assert {t.device.type for t in (layer.packed, layer.scale, layer.minimum)} == {"meta"}
    assert layer.scale.dtype == torch.float32 and layer.packed.dtype == torch.uint8


def test_expert_tiles_cover_each_run_once():
    ends = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # experts 0 and 2 without rows
    expert, start, end = expert_tiles(ends, 4, 21)
    rows = [(int(e), r) for e, s, t in zip(expert, start, end) for r in range(int(s), int(t))]
    bounds = [0] + ends.tolist()
    assert rows == [(e, r) for e in range(5) for r in range(bounds[e], bounds[e + 1])]
    assert all(t - s <= 4 for s, t in zip(start.tolist(), end.tolist()))


@pytest.mark.parametrize("count,tokens,top_k", [(6, 10, 2), (3, 60, 1)])  # 16- and 64-row tiles
def test_moe_kernel_agrees_with_cpu_experts(count, tokens, top_k):
    """An Experts module's grouped projections on the CPU path and through the kernel (the last
    expert never chosen)."""
    gen = torch.Generator().manual_seed(3)
    experts = Experts(count, 32, 48)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(count, 96, 32, generator=gen) * 0.2)
        experts.down_proj.copy_(torch.randn(count, 32, 48, generator=gen) * 0.2)
    x = torch.randn(tokens, 32, generator=gen)
    chosen = torch.stack([torch.randperm(count - 1, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    want = experts(x, chosen, weights)
    pairs = sort_by_expert(chosen, count)
    gate_up = grouped_gemm(x[pairs.token].to(DEVICE), experts.gate_up_proj.detach().to(DEVICE),
                           pairs.ends.to(DEVICE)).cpu()
    down = grouped_gemm(experts.activate(gate_up).to(DEVICE), experts.down_proj.detach().to(DEVICE),
                        pairs.ends.to(DEVICE)).cpu()
    got = torch.zeros_like(x).index_add_(0, pairs.token, down * weights.reshape(-1)[pairs.order, None])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_lora_kernel_agrees_with_cpu_layer():
    """LoraLinear's per-segment loop on the CPU and the two batched launches on the same
    adapters: three ranks, a slot that updates one slice of the fused projection only, rows on
    the base model alone."""
    gen = torch.Generator().manual_seed(4)
    updates = gemm.lora_updates(gen, torch.float32)
    step = StepAdapters({slot: {(0, "qkv"): u} for slot, u in updates.items()}, gemm.LORA_SEGMENTS)
    base = torch.nn.Linear(64, 80)
    x = torch.randn(32, 64, generator=gen)
    with torch.no_grad():
        want = LoraLinear(base, 0, "qkv", step)(x)
        plain = base(x)
    got = plain.to(DEVICE)
    stacked = stack_updates(updates, 80)
    table, max_rows = stacked_segments(gemm.LORA_SEGMENTS, stacked, DEVICE)
    lora_update(x.to(DEVICE), got, stacked.a_t.to(DEVICE), stacked.b_t.to(DEVICE), table, max_rows)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    untouched = [6, 7, 30, 31]  # rows outside every segment: the base output, bit for bit
    assert torch.equal(got.cpu()[untouched], plain[untouched])
