"""Shared-prefix (cascade) decode attention for CUDA in Triton: decode sequences whose block
tables begin with the same blocks (one system prompt or few-shot preamble, n > 1 samples of one
prompt) read those blocks once per step and KV head for the whole group instead of once each.

The host plans the groups once per step (plan_shared_prefixes: sequences with the same first
block, sharing the leading full blocks all of them hold). The prefix kernel runs one program per
(tile of a group's members, KV head): the tile's query rows (MEMBERS sequences x the GQA group's
heads) walk the shared blocks together and write their partial softmax state into the last slot of
the split-K partials (triton_splitk.py); the split-K partial kernel attends each sequence's keys
past its shared prefix into the other slots, and the split-K reduce merges them all (sinks join
there). Soft-capping and fp8 as everywhere; windowed layers do not take this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from batchrun.engine.kernels.triton_attention_common import attend_tile, head_slopes, tile_slots
from batchrun.engine.kernels.triton_decode import decode_launch_args
from batchrun.engine.kernels.triton_splitk import launch_partials, partials, reduce_partials

MIN_SAVING = 0.25  # use the groups when they save at least this share of the decodes' block reads
TILE_MEMBERS = 8  # sequences a prefix-kernel program attends together


@dataclass
class SharedPrefixes:
    """A step's decode groups as the prefix kernel reads them (device tensors)."""
    order: torch.Tensor  # [rows] int32: the groups' member sequences, group after group
    tile_first: torch.Tensor  # [tiles] int32: the tile's first member (an index into order)
    tile_end: torch.Tensor  # [tiles] int32: the end of the tile's group in order
    tile_shared: torch.Tensor  # [tiles] int64: the group's shared tokens (whole blocks)
    skip: torch.Tensor  # [B] int64: each decode's shared tokens (0 outside the groups)


def plan_shared_prefixes(tables: list[list[int]], lens: list[int], block_size: int,
                         device: torch.device,
                         min_saving: float = MIN_SAVING) -> SharedPrefixes | None:
    """The groups of decode sequences with block tables `tables` and context lengths `lens`
    (after this step), or None when they would save less than min_saving of the block reads."""
    by_first: dict[int, list[int]] = {}
    for i, (table, n) in enumerate(zip(tables, lens)):
        if n // block_size:
            by_first.setdefault(table[0], []).append(i)
    order: list[int] = []
    tile_first: list[int] = []
    tile_end: list[int] = []
    tile_shared: list[int] = []
    skip = np.zeros(len(lens), np.int64)
    saved = 0
    for members in by_first.values():
        if len(members) < 2:
            continue
        full = min(lens[i] // block_size for i in members)
        rows = np.array([tables[i][:full] for i in members])
        same = (rows == rows[0]).all(axis=0)
        shared = int(full if same.all() else same.argmin())
        start = len(order)
        order += members
        skip[members] = shared * block_size
        saved += (len(members) - 1) * shared
        for first in range(start, len(order), TILE_MEMBERS):
            tile_first.append(first)
            tile_end.append(len(order))
            tile_shared.append(shared * block_size)
    if not order or saved < min_saving * sum(-(-n // block_size) for n in lens):
        return None
    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return SharedPrefixes(i32(order), i32(tile_first), i32(tile_end),
                          torch.tensor(tile_shared, dtype=torch.long, device=device),
                          torch.from_numpy(skip).to(device))


@triton.jit
def _shared_prefix_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, order_ptr, first_ptr, end_ptr,
                          shared_ptr, alibi_ptr, acc_ptr, ms_ptr, stride_qt, stride_qh,
                          stride_table, qk_scale, softcap, SLOT: tl.constexpr, SLOTS: tl.constexpr,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MEMBERS: tl.constexpr,
                          TILE_MEMBERS: tl.constexpr, BLOCK: tl.constexpr,
                          BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr, FP8: tl.constexpr, PREC: tl.constexpr,
                          DOT: tl.constexpr, HAS_ALIBI: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(first_ptr + tile)
    end = tl.minimum(tl.load(end_ptr + tile), first + TILE_MEMBERS)
    shared = tl.load(shared_ptr + tile).to(tl.int32)
    r = tl.arange(0, MEMBERS * GROUP_PAD)
    member = first + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (member < end) & (g < GROUP)
    seq = tl.load(order_ptr + member, mask=member < end, other=0)
    heads = kvh * GROUP + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + seq[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    slopes = head_slopes(alibi_ptr, heads, row_ok, HAS_ALIBI)
    table_row = tl.load(order_ptr + first).to(tl.int64) * stride_table  # every member's prefix
    m = tl.full([MEMBERS * GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([MEMBERS * GROUP_PAD], tl.float32)
    acc = tl.zeros([MEMBERS * GROUP_PAD, D_PAD], tl.float32)
    t = tl.arange(0, BLOCK_N)
    for start in range(0, shared, BLOCK_N):
        kpos = start + t
        seen = kpos < shared
        slots = tile_slots(tables_ptr, table_row, kpos, seen, BLOCK)
        allowed = seen[None, :] & row_ok[:, None]
        acc, m, s = attend_tile(q, acc, m, s, k_ptr, v_ptr, slots, seen, allowed, kpos,
                                slopes, d, d_ok, kvh, qk_scale, softcap, HKV, D,
                                HAS_SOFTCAP, HAS_ALIBI, FP8, PREC)
    out_row = (seq * H + heads) * SLOTS + SLOT
    tl.store(acc_ptr + out_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(ms_ptr + out_row * 2, m, mask=row_ok)
    tl.store(ms_ptr + out_row * 2 + 1, s, mask=row_ok)


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                             scale: float, groups: SharedPrefixes, splits: int = 1,
                             softcap: float | None = None, sinks: torch.Tensor | None = None,
                             k_scale: float = 1.0, v_scale: float = 1.0,
                             alibi: torch.Tensor | None = None) -> torch.Tensor:
    """As triton_decode.paged_decode_attention (no window), each group's shared prefix read once
    for the group, the rest of each context in `splits` shares."""
    args, consts = decode_launch_args(q, k_cache, v_cache, block_size, None, softcap, sinks,
                                      alibi)
    acc, ms = partials(q, splits + 1)
    acc[:, :, splits].zero_()  # the prefix slot of sequences outside the groups
    ms[:, :, splits, 0].fill_(float("-inf"))
    ms[:, :, splits, 1].zero_()
    launch_partials(q, args, consts, tables, lens, groups.skip, acc, ms, scale * k_scale, None,
                    softcap, splits)
    kc, vc, _, alibi = args
    consts = {k: v for k, v in consts.items() if k not in ("HAS_WINDOW", "HAS_SINKS")}
    group_pad = triton.next_power_of_2(consts["GROUP"])
    consts["GROUP_PAD"] = group_pad
    members = max(TILE_MEMBERS, 16 // group_pad)  # rows for tl.dot's 16, the extra ones masked
    _shared_prefix_kernel[(groups.tile_first.shape[0], consts["HKV"])](
        q, kc, vc, tables, groups.order, groups.tile_first, groups.tile_end, groups.tile_shared,
        groups.skip if alibi is None else alibi, acc, ms, q.stride(0), q.stride(1),
        tables.stride(0), scale * k_scale, softcap or 0.0,
        SLOT=splits, SLOTS=splits + 1, H=q.shape[1], MEMBERS=members, TILE_MEMBERS=TILE_MEMBERS,
        **consts)
    return reduce_partials(acc, ms, args[2], consts | {"HAS_SINKS": sinks is not None}, v_scale,
                           q.dtype)

