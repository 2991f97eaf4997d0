"""The gated delta rule kernels (engine/kernels/triton_gated_delta.py) against the plain recurrence
in float64, on a step of packed sequences of mixed lengths (a decode's one token, a prefill
across several 16-token chunks, one shorter than a chunk) with grouped heads (2 query/key heads
for 4 value heads), 72 value columns (the Triton kernels' two column blocks, one partial) and
states carried in from scattered slots. tests/unit/test_gated_delta_kernels.py holds the C kernel and
the PyTorch path to the same problem and reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from batchrun.engine.kernels import triton_gated_delta

TOL = 1e-4  # float32 against float64: rounding only, over a few dozen steps of the state


@dataclass
class Problem:
    q: torch.Tensor  # [T, Hk, dk] L2-normalised, scaled
    k: torch.Tensor  # [T, Hk, dk] L2-normalised
    v: torch.Tensor  # [T, Hv, dv]
    g: torch.Tensor  # [T, Hv] log decay
    beta: torch.Tensor  # [T, Hv]
    state: torch.Tensor  # [slots, Hv, dk, dv] before the step
    slots: torch.Tensor  # [S] each sequence's
    query_start: torch.Tensor  # [S + 1]

    @property
    def max_count(self) -> int:
        return int((self.query_start[1:] - self.query_start[:-1]).max())

    def on(self, device: torch.device) -> "Problem":
        return Problem(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def make_problem(counts=(1, 40, 9, 1), hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 72,
                 seed: int = 0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)

    q = unit(torch.randn(t, hk, dk, generator=gen)) * dk ** -0.5
    k = unit(torch.randn(t, hk, dk, generator=gen))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.5
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(len(counts) + 3, hv, dk, dv, generator=gen) * 0.1
    slots = torch.randperm(len(counts) + 3, generator=gen)[:len(counts)]
    start = torch.tensor([0, *counts]).cumsum(0)
    return Problem(q, k, v, g, beta, state, slots, start)


def reference(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, Hv, dv], the state after the step) by the recurrence, token by token, float64."""
    groups = p.v.shape[1] // p.k.shape[1]
    state = p.state.double().clone()
    out = torch.zeros(p.v.shape, dtype=torch.float64)
    for i, slot in enumerate(p.slots.tolist()):
        S = state[slot]  # [Hv, dk, dv], a view: updated in place below
        for t in range(int(p.query_start[i]), int(p.query_start[i + 1])):
            q, k = (x[t].double().repeat_interleave(groups, 0) for x in (p.q, p.k))
            S.mul_(p.g[t].double().exp()[:, None, None])
            remembered = torch.einsum("hkv,hk->hv", S, k)
            delta = p.beta[t].double()[:, None] * (p.v[t].double() - remembered)
            S.add_(k[:, :, None] * delta[:, None, :])
            out[t] = torch.einsum("hkv,hk->hv", S, q)
    return out, state


def run_check(kernel: Callable[..., torch.Tensor], device: torch.device) -> tuple[float, float]:
    """The largest error of `kernel`'s outputs and of the states it leaves (untouched slots
    included) against the reference."""
    p = make_problem()
    expected_out, expected_state = reference(p)
    d = p.on(device)
    out = kernel(d.q, d.k, d.v, d.g, d.beta, d.state, d.slots, d.query_start, p.max_count)
    err = max(float((out.double().cpu() - expected_out).abs().max()),
              float((d.state.double().cpu() - expected_state).abs().max()))
    return err, TOL


def check_prefill(device: torch.device) -> tuple[float, float]:
    return run_check(lambda *a: triton_gated_delta.chunked(*a, chunk=16), device)


def check_decode(device: torch.device) -> tuple[float, float]:
    return run_check(triton_gated_delta.recurrent, device)


CHECKS: dict[str, Callable[[torch.device], tuple[float, float]]] = {
    "gated_delta_prefill": check_prefill,
    "gated_delta_decode": check_decode,
}
