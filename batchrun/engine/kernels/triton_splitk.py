"""Split-K (flash-decoding) paged decode attention for CUDA in Triton, for long contexts where
one program per (sequence, KV head) would leave most of the GPU idle.

The partial kernel runs one program per (sequence, KV head, split): split j walks its share of the
sequence's key tiles (the shares computed on the device from the context length, so the launch
has fixed shapes and is captured in CUDA graphs like the plain decode kernel) and writes its
unnormalised output with its running max and sum. The reduce kernel, one program per (sequence,
head), rescales the splits to their common max and divides by the total sum, where a head's
sink joins it. Windows, soft-capping and fp8 caches as in triton_decode.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_attention_common import attend_keys, decode_group
from batchrun.engine.kernels.triton_decode import decode_launch_args


@triton.jit
def _splitk_partial_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, skip_ptr, alibi_ptr,
                           acc_ptr, ms_ptr,
                           stride_qt, stride_qh, stride_table, qk_scale, window, softcap,
                           SPLITS: tl.constexpr, SLOTS: tl.constexpr, H: tl.constexpr,
                           HKV: tl.constexpr,
                           D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                           HAS_SINKS: tl.constexpr, FP8: tl.constexpr, PREC: tl.constexpr,
                           DOT: tl.constexpr, HAS_SKIP: tl.constexpr,
                           HAS_ALIBI: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    q, heads, g_ok, d, d_ok, slopes, lo = decode_group(
        q_ptr, alibi_ptr, seq, kvh, stride_qt, stride_qh, length, window, D, GROUP, GROUP_PAD,
        D_PAD, HAS_WINDOW, HAS_ALIBI, DOT)
    if HAS_SKIP:  # keys another kernel attends (cascade: a shared prefix)
        lo = tl.maximum(lo, tl.load(skip_ptr + seq).to(tl.int32))
    first_tile = lo // BLOCK_N
    per_split = tl.cdiv(tl.cdiv(length, BLOCK_N) - first_tile, SPLITS)
    begin = (first_tile + split * per_split) * BLOCK_N
    end = tl.minimum(begin + per_split * BLOCK_N, length)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    acc, m, s = attend_keys(q, acc, m, s, k_ptr, v_ptr, tables_ptr, seq * stride_table, begin,
                            end, lo, length, slopes, g_ok, d, d_ok, kvh, qk_scale, softcap, HKV,
                            D, BLOCK, BLOCK_N, HAS_SOFTCAP, HAS_ALIBI, FP8, PREC)
    row = (seq * H + heads) * SLOTS + split  # [B, H, SLOTS] partials
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(ms_ptr + row * 2, m, mask=g_ok)
    tl.store(ms_ptr + row * 2 + 1, s, mask=g_ok)


@triton.jit
def _splitk_reduce_kernel(acc_ptr, ms_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh, v_scale,
                          SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, H: tl.constexpr,
                          D: tl.constexpr, D_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    j_ok = j < SPLITS
    row = (seq * H + head) * SPLITS + j
    m = tl.load(ms_ptr + row * 2, mask=j_ok, other=float("-inf"))
    s = tl.load(ms_ptr + row * 2 + 1, mask=j_ok, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=j_ok[:, None] & (d < D)[None, :],
                  other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_safe)
    total = tl.sum(s * w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    out = tl.sum(acc * w[:, None], axis=0) * (v_scale / tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)


def splitk_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                            scale: float, splits: int, window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            alibi: torch.Tensor | None = None) -> torch.Tensor:
    """As triton_decode.paged_decode_attention, each sequence's keys in `splits` shares."""
    args, consts = decode_launch_args(q, k_cache, v_cache, block_size, window, softcap, sinks,
                                      alibi)
    acc, ms = partials(q, splits)
    launch_partials(q, args, consts, tables, lens, None, acc, ms, scale * k_scale, window,
                    softcap, splits)
    return reduce_partials(acc, ms, args[2], consts, v_scale, q.dtype)


def partials(q: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for `slots` partial results per (sequence, head): (acc [B, H, slots, D], (m, s)
    [B, H, slots, 2]), float32; a slot no kernel writes must hold (0, -inf, 0)."""
    b, h, dim = q.shape
    return (torch.empty(b, h, slots, dim, dtype=torch.float32, device=q.device),
            torch.empty(b, h, slots, 2, dtype=torch.float32, device=q.device))


def launch_partials(q: torch.Tensor, args: tuple, consts: dict, tables: torch.Tensor,
                    lens: torch.Tensor, skip: torch.Tensor | None, acc: torch.Tensor,
                    ms: torch.Tensor, qk_scale: float, window: int | None,
                    softcap: float | None, splits: int) -> None:
    """The partial kernel into slots 0..splits-1 of acc / ms; skip [B]: keys before skip[seq]
    are left out (None: none)."""
    kc, vc, _, alibi = args
    _splitk_partial_kernel[(q.shape[0], consts["HKV"], splits)](
        q, kc, vc, tables, lens, lens if skip is None else skip, lens if alibi is None else alibi,
        acc, ms, q.stride(0),
        q.stride(1), tables.stride(0), qk_scale, window or 0, softcap or 0.0, SPLITS=splits,
        SLOTS=acc.shape[2], H=q.shape[1], HAS_SKIP=skip is not None, **consts)


def reduce_partials(acc: torch.Tensor, ms: torch.Tensor, sinks: torch.Tensor | None,
                    consts: dict, v_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The attention output [B, H, D] from every slot of the partials."""
    b, h, slots, dim = acc.shape
    out = torch.empty(b, h, dim, dtype=dtype, device=acc.device)
    _splitk_reduce_kernel[(b, h)](
        acc, ms, ms if sinks is None else sinks, out, out.stride(0), out.stride(1), v_scale,
        SPLITS=slots, SPLITS_PAD=triton.next_power_of_2(slots), H=h, D=dim,
        D_PAD=consts["D_PAD"], HAS_SINKS=consts["HAS_SINKS"])
    return out


def choose_splits(batch: int, kv_heads: int, max_context: int, block_size: int,
                  programs: int) -> int:
    """Splits for a decode launch over contexts up to max_context tokens: enough programs to fill
    `programs` (about two per SM) when batch * kv_heads alone does not, at least 256 keys a split
    (a split's fixed cost is its query load and its partial's write); 1 means the plain kernel."""
    if batch * kv_heads >= programs // 2:
        return 1
    by_length = max(1, max_context // max(256, block_size))
    return max(1, min(by_length, triton.cdiv(programs, batch * kv_heads), 32))
