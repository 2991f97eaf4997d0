"""The gated delta rule on CUDA in Triton (gated_delta.py has the maths and the layout of the
inputs and the state slots).

Both kernels run one program per (sequence, value head, block of up to 64 value columns): the
rule never mixes a state's columns (column j reads v's j-th entries only), so each program holds
its [DK, BV] share of the state in registers from its slot to the end of the sequence's rows.
`recurrent` steps token by token (a decode's one token, the cheapest launch). `chunked` takes
the sequence CHUNK tokens at a time: the chunk's keys interact through the strictly lower L =
(beta k k^T) * D, inverted at once as (I + L)^-1 = (I - L)(I + L^2)(I + L^4)... (L is nilpotent:
log2(CHUNK) products of CHUNK x CHUNK matrices), so each chunk is a handful of matrix products
on the tensor cores (float32, IEEE products: the state feeds back every chunk). Rows past a
sequence's end load as zeros (k = v = g = beta = 0), which leave the state as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _program(slots_ptr, start_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This program's sequence rows [start, end), value head h (key head kh), key rows i, value
    columns j, and where its [DK, DV] tile of the sequence's state lies (at, ok)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    start = tl.load(start_ptr + seq)
    end = tl.load(start_ptr + seq + 1)
    i = tl.arange(0, BK)
    j = tl.program_id(2) * BV + tl.arange(0, BV)  # this program's value columns
    at = (tl.load(slots_ptr + seq).to(tl.int64) * HV + h) * DK * DV + i[:, None] * DV + j[None, :]
    ok = (i[:, None] < DK) & (j[None, :] < DV)
    return h, kh, start, end, i, j, at, ok


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, start_ptr,
                      out_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    h, kh, start, end, i, j, at, ok = _program(slots_ptr, start_ptr, HK, HV, DK, DV, BK, BV)
    S = tl.load(state_ptr + at, mask=ok, other=0.0)
    for t in range(start, end):
        qk_at = (t * HK + kh) * DK + i
        q = tl.load(q_ptr + qk_at, mask=i < DK, other=0.0)
        k = tl.load(k_ptr + qk_at, mask=i < DK, other=0.0)
        v = tl.load(v_ptr + (t * HV + h) * DV + j, mask=j < DV, other=0.0)
        S = S * tl.exp(tl.load(g_ptr + t * HV + h))
        delta = tl.load(beta_ptr + t * HV + h) * (v - tl.sum(S * k[:, None], 0))
        S = S + k[:, None] * delta[None, :]
        tl.store(out_ptr + (t * HV + h) * DV + j, tl.sum(S * q[:, None], 0), mask=j < DV)
    tl.store(state_ptr + at, S, mask=ok)


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, start_ptr,
                  out_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                  LOG2_BT: tl.constexpr):
    h, kh, start, end, i, j, at, ok = _program(slots_ptr, start_ptr, HK, HV, DK, DV, BK, BV)
    r = tl.arange(0, BT)
    S = tl.load(state_ptr + at, mask=ok, other=0.0)
    lower = r[:, None] >= r[None, :]
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for c in range(start, end, BT):
        t = c + r
        t_ok = t < end
        qk_at = (t[:, None] * HK + kh) * DK + i[None, :]
        qk_ok = t_ok[:, None] & (i[None, :] < DK)
        q = tl.load(q_ptr + qk_at, mask=qk_ok, other=0.0)
        k = tl.load(k_ptr + qk_at, mask=qk_ok, other=0.0)
        v_at = (t[:, None] * HV + h) * DV + j[None, :]
        v_ok = t_ok[:, None] & (j[None, :] < DV)
        v = tl.load(v_ptr + v_at, mask=v_ok, other=0.0)
        g = tl.load(g_ptr + t * HV + h, mask=t_ok, other=0.0)
        beta = tl.load(beta_ptr + t * HV + h, mask=t_ok, other=0.0)
        G = tl.cumsum(g, 0)
        D = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
        kb = k * beta[:, None]
        L = tl.where(r[:, None] > r[None, :],
                     tl.dot(kb, tl.trans(k), input_precision="ieee") * D, 0.0)
        N = -L  # (I + L)^-1 = prod_m (I + N^(2^m))
        T = eye + N
        for _ in tl.static_range(LOG2_BT - 1):
            N = tl.dot(N, N, input_precision="ieee")
            T = T + tl.dot(T, N, input_precision="ieee")
        eG = tl.exp(G)
        U = tl.dot(T, v * beta[:, None], input_precision="ieee") - tl.dot(
            tl.dot(T, kb * eG[:, None], input_precision="ieee"), S, input_precision="ieee")
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * D
        o = tl.dot(q * eG[:, None], S, input_precision="ieee") + tl.dot(
            scores, U, input_precision="ieee")
        tl.store(out_ptr + v_at, o, mask=v_ok)
        last = tl.sum(g, 0)
        S = S * tl.exp(last) + tl.dot(tl.trans(k * tl.exp(last - G)[:, None]), U,
                                      input_precision="ieee")
    tl.store(state_ptr + at, S, mask=ok)


def _launch(kernel, q, k, v, g, beta, state, slots, query_start, **extra) -> torch.Tensor:
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the gated delta state must be float32 and contiguous")
    out = torch.empty_like(v)
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    bv = min(64, max(16, triton.next_power_of_2(dv)))
    kernel[(len(slots), hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, slots, query_start.long().contiguous(), out, HK=hk, HV=hv,
        DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=bv, **extra)
    return out


def recurrent(q, k, v, g, beta, state, slots, query_start, max_count: int = 1) -> torch.Tensor:
    """o [T, Hv, dv] float32, token by token (gated_delta.gated_delta_rule's arguments)."""
    return _launch(_recurrent_kernel, q, k, v, g, beta, state, slots, query_start)


def chunked(q, k, v, g, beta, state, slots, query_start, max_count: int = 0,
            chunk: int = CHUNK) -> torch.Tensor:
    """o [T, Hv, dv] float32, `chunk` (a power of two, >= 16) tokens at a time."""
    return _launch(_chunk_kernel, q, k, v, g, beta, state, slots, query_start, BT=chunk,
                   LOG2_BT=chunk.bit_length() - 1)
