"""The gated delta rule (Qwen3-Next's linear attention) over a step's packed sequences, each
continuing its own state slot, by whichever path the device has: Triton on CUDA
(triton_gated_delta.py: a recurrent kernel for decodes, the chunked one for prefills), the C
kernel on the CPU (gated_delta.c, a token loop), else the chunked form in PyTorch here.

Per value head, with S [dk, dv] the state: S <- exp(g_t) S; S <- S + beta_t k_t (v_t - S^T
k_t)^T; o_t = S^T q_t. The inputs arrive as the kernels read them: q, k [T, Hk, dk] already
L2-normalised (q also scaled by dk^-0.5), v [T, Hv, dv], g (the log of the decay) and beta
[T, Hv], float32; value head h reads query/key head h // (Hv // Hk). The state tensor is
[slots, Hv, dk, dv] float32, read and written at each sequence's slot (a fresh sequence's slot
zeroed by the caller first).

The chunked form (per chunk of C tokens, G the cumulative sum of g within it, D[i, j] =
exp(G_i - G_j) for j <= i): the chunk's own updates interact through the strictly lower
L = (beta k k^T) * D, undone at once by the UT transform T = (I + L)^-1; the corrected values
U = T (beta v) - T (beta exp(G) k) S then give o = (exp(G) q) S + ((q k^T) * D) U and the next
state exp(G_C) S + (exp(G_C - G) k)^T U.
"""

from __future__ import annotations

import torch

CHUNK = 64


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     query_start: torch.Tensor, max_count: int, kernels=None) -> torch.Tensor:
    """o [T, Hv, dv] float32 of the step's packed sequences (sequence i: rows query_start[i]:
    query_start[i + 1], state slot slots[i]); `kernels`: the CPU library (None: PyTorch)."""
    if q.is_cuda:
        from batchrun.engine.kernels import triton_gated_delta

        run = triton_gated_delta.recurrent if max_count == 1 else triton_gated_delta.chunked
        return run(q, k, v, g, beta, state, slots, query_start, max_count)
    if kernels is not None:
        return kernels.gated_delta_rule(q, k, v, g, beta, state, slots, query_start)
    # a step of short rows (decodes) in chunks of its longest: no padding to 64 positions
    return chunked(q, k, v, g, beta, state, slots, query_start, max_count,
                   chunk=min(CHUNK, max_count))


def padded(x: torch.Tensor, query_start: torch.Tensor, length: int) -> torch.Tensor:
    """x [T, H, ...] as [S, H, length, ...]: sequence i's rows first, zeros after."""
    counts = query_start[1:] - query_start[:-1]
    offsets = torch.arange(length, device=x.device)
    valid = offsets[None, :] < counts[:, None]
    rows = torch.where(valid, query_start[:-1, None] + offsets[None, :], 0)
    out = x[rows] * valid.view(*valid.shape, *([1] * (x.dim() - 1)))
    return out.transpose(1, 2)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
            query_start: torch.Tensor, max_count: int, chunk: int = CHUNK) -> torch.Tensor:
    """The chunked form in PyTorch, every sequence and head at once (padding positions have
    k = v = g = beta = 0: they leave the state as it is)."""
    groups = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    length = -(-max_count // chunk) * chunk
    qp, kp, vp = (padded(x.float(), query_start, length) for x in (q, k, v))  # [S, H, L, d]
    gp, bp = (padded(x.float(), query_start, length) for x in (g, beta))  # [S, H, L]
    S = state[slots].float()
    outs = []
    for c in range(0, length, chunk):
        part = slice(c, c + chunk)
        o, S = chunk_step(qp[:, :, part], kp[:, :, part], vp[:, :, part], gp[:, :, part],
                          bp[:, :, part], S)
        outs.append(o)
    state[slots] = S.to(state.dtype)
    o = torch.cat(outs, dim=2).transpose(1, 2)  # [S, L, H, dv]
    counts = query_start[1:] - query_start[:-1]
    valid = torch.arange(length, device=q.device)[None, :] < counts[:, None]
    return o[valid]


def chunk_step(q, k, v, g, beta, S):
    """One chunk ([..., C, d]; g, beta [..., C]) from state S [..., dk, dv]: (o, next S)."""
    C = q.shape[-2]
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf"))
    D = diff.exp()
    kb = k * beta[..., None]
    L = (kb @ k.transpose(-1, -2) * D).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    U = T @ (v * beta[..., None]) - (T @ (kb * G.exp()[..., None])) @ S
    o = (q * G.exp()[..., None]) @ S + ((q @ k.transpose(-1, -2)) * D) @ U
    last = G[..., -1:]
    S = S * last.exp()[..., None] + (k * (last - G).exp()[..., None]).transpose(-1, -2) @ U
    return o, S
