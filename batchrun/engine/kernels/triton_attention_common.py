"""What the Triton attention kernels share (triton_prefill.py, triton_decode.py,
triton_splitk.py, triton_cascade.py): reading a tile of keys/values through a block table where
they lie, an fp8 cache's bytes widened in-kernel, one online-softmax step over a key tile with
the layer's soft-cap and ALiBi slopes, and the final division where sinks join.

A key tile is BLOCK_N consecutive positions of one sequence; each position's slot is its block's
id (from the block table) * block size + its offset, so a tile may span several cache blocks and
no K/V is gathered into a copy. Scores go through tl.dot (a query tile of at least 16 rows on a
GPU: decode pads its GQA group to 16) in the query's dtype, float32 inputs in IEEE precision
(TF32 would cost float32 models their exactness); under Triton's interpreter bfloat16 dots run
in float32 (dot_dtype)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot's smallest M, N and K on a GPU


@triton.jit
def load_kv(ptr, mask, FP8: tl.constexpr):
    """Cache elements as float32. FP8: the pointer is the e4m3 cache's uint8 view, widened through
    float16 (e4m3's bits shifted into a half's are the value times 2^-8, subnormals included), so
    no GPU generation's fp8 conversion support matters."""
    if FP8:
        x = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        half = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def tile_slots(tables_ptr, table_row, kpos, seen, BLOCK: tl.constexpr):
    """Each key position's cache slot (positions not `seen` read block 0, masked later)."""
    block = tl.load(tables_ptr + table_row + kpos // BLOCK, mask=seen, other=0)
    return block * BLOCK + kpos % BLOCK


@triton.jit
def attend_tile(q, acc, m, s, k_ptr, v_ptr, slots, seen, allowed, kpos, slopes, d, d_ok, kvh,
                qk_scale, softcap, HKV: tl.constexpr, D: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, FP8: tl.constexpr,
                PREC: tl.constexpr):
    """One online-softmax step: q [M, D_PAD] (the kernel's dot dtype) against the keys at
    positions kpos [N] (cache slots `slots`) of KV head kvh; allowed [M, N] masks scores;
    HAS_ALIBI: row r's scores gain slopes[r] * the key's position (after the soft-cap, as
    reference.attend adds its bias). Returns (acc, m, s) updated. A row with nothing allowed so
    far keeps m = -inf and contributes nothing."""
    offs = (slots[:, None] * HKV + kvh) * D + d[None, :]
    kv_mask = seen[:, None] & d_ok[None, :]
    k = load_kv(k_ptr + offs, kv_mask, FP8).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without NaN where exp overflows
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    if HAS_ALIBI:
        scores += slopes[:, None] * kpos[None, :].to(tl.float32)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    s = s * alpha + tl.sum(p, axis=1)
    v = load_kv(v_ptr + offs, kv_mask, FP8).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
    return acc, m_new, s


@triton.jit
def decode_group(q_ptr, alibi_ptr, seq, kvh, stride_qt, stride_qh, length, window,
                 D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 DOT: tl.constexpr):
    """A decode program's query rows (the GROUP heads of KV head kvh, padded), what it needs to
    index them, and the first key position it may see: (q, heads, g_ok, d, d_ok, slopes, lo)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    slopes = head_slopes(alibi_ptr, heads, g_ok, HAS_ALIBI)
    lo = length * 0
    if HAS_WINDOW:
        lo = tl.maximum(length - window, 0)
    return q, heads, g_ok, d, d_ok, slopes, lo


@triton.jit
def attend_keys(q, acc, m, s, k_ptr, v_ptr, tables_ptr, table_row, begin, end, lo, length,
                slopes, g_ok, d, d_ok, kvh, qk_scale, softcap, HKV: tl.constexpr,
                D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, FP8: tl.constexpr,
                PREC: tl.constexpr):
    """A decode program's walk over key tiles [begin, end) of its sequence (keys below `lo` or
    at `length` and past masked), one attend_tile a tile; returns (acc, m, s)."""
    t = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        kpos = start + t
        seen = (kpos < length) & (kpos >= lo)
        slots = tile_slots(tables_ptr, table_row, kpos, seen, BLOCK)
        allowed = seen[None, :] & g_ok[:, None]
        acc, m, s = attend_tile(q, acc, m, s, k_ptr, v_ptr, slots, seen, allowed, kpos,
                                slopes, d, d_ok, kvh, qk_scale, softcap, HKV, D,
                                HAS_SOFTCAP, HAS_ALIBI, FP8, PREC)
    return acc, m, s


@triton.jit
def head_slopes(alibi_ptr, heads, ok, HAS_ALIBI: tl.constexpr):
    """The rows' ALiBi slopes (their heads'), zeros without ALiBi."""
    if HAS_ALIBI:
        return tl.load(alibi_ptr + heads, mask=ok, other=0.0).to(tl.float32)
    else:
        return tl.zeros(heads.shape, tl.float32)


@triton.jit
def finish(acc, m, s, sinks_ptr, heads, head_ok, v_scale, HAS_SINKS: tl.constexpr):
    """acc / the softmax sum (a head's sink logit joining the sum), times the V scale."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
        m_all = tl.maximum(m, sink)
        alpha = tl.exp(m - m_all)
        s = s * alpha + tl.exp(sink - m_all)
        acc = acc * alpha[:, None]
    return acc * (v_scale / tl.where(s > 0, s, 1.0))[:, None]


def dot_dtype(q: torch.Tensor) -> tuple[str, tl.dtype]:
    """(tl.dot's input precision, the dtype the kernels' dots take) for a query tensor: q's own,
    float32 in IEEE precision for a float32 q, and float32 for bfloat16 under Triton's
    interpreter (whose tl.dot multiplies bfloat16's raw bits as integers: numpy has no bfloat16)."""
    if q.dtype == torch.float32:
        return "ieee", tl.float32
    if q.dtype == torch.bfloat16:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        return "tf32", tl.float32 if interpreted else tl.bfloat16
    if q.dtype == torch.float16:
        return "tf32", tl.float16
    raise TypeError(f"no Triton attention for {q.dtype} queries")


def cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The caches as the kernels read them: an fp8 cache as its bytes (FP8 set)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), True
    return k_cache, v_cache, False


def key_tile(block_size: int, keys: int) -> int:
    """Keys per tile: `keys` (the kernel's choice for its head dim: tiles as wide as registers
    allow without spilling, by ptxas's report for sm_90; a 16-token block per tile would make the
    dots small), or one cache block where blocks are larger; under the interpreter tl.dot's
    minimum, so the checks' small contexts span several tiles."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        keys = MIN_DOT
    return max(keys, triton.next_power_of_2(block_size))
