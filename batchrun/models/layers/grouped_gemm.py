"""Grouped GEMM over (token, expert) pairs sorted by expert: the MoE experts without a Python loop.

`sort_by_expert` orders a step's top-k choices by expert and lists the active experts;
`grouped_mm` multiplies each expert's run of rows by that expert's weight in one call:
- few rows per active expert (decode), with the CPU kernels: engine/kernels/expert_gemm.c, which
  visits the active experts only;
- on CUDA, the Triton grouped GEMM (engine/kernels/triton_moe.py), one launch over all experts;
- otherwise torch._grouped_mm where the device and dtype take it (the CPU in float32 and bfloat16
  with torch 2.13; its loop over all groups costs about 1 us per empty one, small beside a
  prefill's GEMMs);
- else a gather of each pair's expert weight and a batched matmul.
The work follows the number of pairs, not the number of experts.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch


log = logging.getLogger(__name__)
KERNEL_ROWS_PER_EXPERT = 16  # up to this many rows per active expert on average: the C kernel


@dataclass(frozen=True)
class ExpertPairs:
    order: torch.Tensor  # [pairs]: indices into the flattened [tokens, top_k] choices, by expert
    token: torch.Tensor  # [pairs]: the token of each sorted pair
    expert: torch.Tensor  # [pairs]: the expert of each sorted pair
    ends: torch.Tensor  # [experts] int32: where each expert's run of sorted pairs ends
    active: torch.Tensor  # [active experts] int64: the experts with at least one pair
    bounds: torch.Tensor  # [active + 1] int64: where each active expert's run starts (and ends)


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> ExpertPairs:
    """experts: [tokens, top_k] expert ids."""
    flat = experts.reshape(-1)
    sorted_experts, order = flat.sort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    active = counts.nonzero().squeeze(1)
    bounds = torch.zeros(len(active) + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts[active], 0, out=bounds[1:])
    return ExpertPairs(order, order // experts.shape[1], sorted_experts,
                       counts.cumsum(0).to(torch.int32), active, bounds)


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, pairs: ExpertPairs,
               cpu_kernels=None) -> torch.Tensor:
    """rows [pairs, in] sorted by expert, weights [experts, out, in]: row i times the transposed
    weight of its expert, [pairs, out]."""
    if cpu_kernels is not None and len(rows) <= KERNEL_ROWS_PER_EXPERT * len(pairs.active):
        return cpu_kernels.expert_gemm(rows, weights, pairs.active, pairs.bounds)
    if rows.is_cuda:
        from batchrun.engine.kernels.triton_moe import grouped_gemm

        return grouped_gemm(rows, weights, pairs.ends)
    if _native_grouped_mm(rows.device.type, rows.dtype):
        return torch._grouped_mm(rows, weights.transpose(1, 2), offs=pairs.ends)
    return torch.bmm(weights[pairs.expert], rows.unsqueeze(-1)).squeeze(-1)


@functools.lru_cache(maxsize=None)
def _native_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs (and is right) on this device and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(3, 8, 16, generator=gen).to(device_type, dtype)
        x = torch.randn(5, 16, generator=gen).to(device_type, dtype)
        ends = torch.tensor([2, 2, 5], dtype=torch.int32, device=device_type)
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=ends).float()
        want = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T]).float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError) as exc:  # not built for this device or dtype
        log.info("torch._grouped_mm unavailable on %s %s: %s", device_type, dtype, exc)
        return False


def route(experts_module, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
          cpu_kernels=None) -> torch.Tensor:
    """An experts module's forward: the (token, expert) pairs sorted by expert through its
    `project` and `activate`, weighted and summed back per token."""
    pairs = sort_by_expert(experts, experts_module.num_experts)
    gate_up = experts_module.project(x[pairs.token], "gate_up_proj", pairs, cpu_kernels)
    out = experts_module.project(experts_module.activate(gate_up, cpu_kernels), "down_proj", pairs,
                                 cpu_kernels)
    out *= weights.reshape(-1)[pairs.order, None]
    return torch.zeros_like(x).index_add_(0, pairs.token, out)
