"""Which rows of a step the C attention kernel takes, and in which groups (once per step).

Decode sequences are grouped by the C function cascade_groups (sorted block tables, then runs
that share the most leading physical blocks): a group reads its shared blocks once per step and
layer for all its sequences. A prefill chunk over a cached context becomes groups of up to
TILE consecutive tokens that read the blocks every token of the tile sees once. A step where
nothing is shared and no chunk has a cached context returns None (unless every chunk and row is
asked for): the plain decode kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TILE = 16  # MAX_GROUP in paged_attention.c


@dataclass
class KernelRows:
    """The rows of a step the C kernel attends (paged_attention in paged_attention.c): row r
    (a token of the step) reads table row_table[r] of `tables` up to position row_len[r]; rows
    are attended in groups (order[group_start[g]:group_start[g + 1]]) that read their first
    group_shared[g] blocks once for the whole group."""
    tables: torch.Tensor  # [N, max_blocks] int64
    row_table: torch.Tensor  # [T] int64
    row_len: torch.Tensor  # [T] int64
    order: torch.Tensor  # [rows in groups] int32
    group_start: torch.Tensor  # [groups + 1] int32
    group_shared: torch.Tensor  # [groups] int32
    # [T] int64 or None (= row_len): where each row's causal context ends, which a sliding window
    # is measured from when row_len reaches past it (rows that see ahead: plan_seeing_ahead)
    causal_len: torch.Tensor | None = None
    # Each row scored as it is alone, the shared blocks still read once for its group (cut to a
    # whole number of the kernel's tiles): --batch-invariant's grouping (attention/invariant.py).
    per_row: bool = False

    @property
    def groups(self) -> int:
        return self.group_shared.shape[0]


def supported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Shapes paged_attention takes on every vector path (head_dim a multiple of 16)."""
    return (head_dim % 16 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16 and block_size <= 256)


def decode_groups(kernel, tables: torch.Tensor, lens: torch.Tensor, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, group_start, shared) for decode sequences with block tables [B, W] (int64,
    contiguous) and context lengths [B] (int64)."""
    if tables.shape[0] == 1:
        return np.zeros(1, np.int32), np.array([0, 1], np.int32), np.zeros(1, np.int32)
    return kernel.cascade_groups(tables, lens, block_size, TILE)


def plan_rows(kernel, table: torch.Tensor, starts: list[int], counts: list[int], num_decode: int,
              block_size: int, every_chunk: bool = False) -> tuple[KernelRows | None, list[bool]]:
    """The kernel's rows for a step laid out as the runner does (decodes first, then chunks;
    request i has `table[i]`, starts[i] computed tokens and counts[i] scheduled), and for each
    prefill chunk whether the kernel attends it: a chunk over a cached context, or with
    every_chunk any chunk (a soft-capped layer's, which SDPA cannot attend; --batch-invariant's
    every row), and then rows even where nothing is shared."""
    bs = block_size
    orders, group_starts, shareds = [], [], []
    total = sum(counts)
    row_table = np.zeros(total, np.int64)
    row_len = np.zeros(total, np.int64)
    shared_any = False
    if num_decode:
        lens = torch.tensor(starts[:num_decode], dtype=torch.long) + 1
        order, start, shared = decode_groups(kernel, table[:num_decode], lens, bs)
        row_table[:num_decode] = np.arange(num_decode)
        row_len[:num_decode] = lens.numpy()
        orders.append(order)
        group_starts.append(start[:-1])
        shareds.append(shared)
        shared_any = bool(shared.any())
    in_kernel = []
    row, ordered = num_decode, num_decode  # ordered: rows in `orders` so far
    for i in range(num_decode, len(counts)):
        c, n = starts[i], counts[i]
        in_kernel.append(c > 0 or every_chunk)
        if in_kernel[-1]:
            j = np.arange(n)
            row_table[row:row + n] = i
            row_len[row:row + n] = c + j + 1
            tiles = j[::TILE]
            orders.append((row + j).astype(np.int32))
            group_starts.append((ordered + tiles).astype(np.int32))
            ordered += n
            shareds.append(((c + tiles + 1) // bs).astype(np.int32))
        row += n
    if not shared_any and not any(in_kernel) and not every_chunk:
        return None, in_kernel
    order = np.concatenate(orders)
    group_start = np.concatenate(group_starts + [np.array([len(order)], np.int32)])
    return KernelRows(table, torch.from_numpy(row_table), torch.from_numpy(row_len),
                      torch.from_numpy(order), torch.from_numpy(group_start),
                      torch.from_numpy(np.concatenate(shareds))), in_kernel


def plan_seeing_ahead(table: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                      until: torch.Tensor, block_size: int) -> KernelRows:
    """Every row of a step in the kernel, where row r also sees the keys of its sequence before
    position until[r] (AttentionMetadata.visible_until: an image's tokens attend both ways within
    the image, the whole image in this step): its row_len is max(position + 1, until[r]).
    Rows are grouped in tiles of TILE consecutive rows of one sequence that share the blocks
    every row of the tile sees."""
    starts = query_start.cpu().numpy()
    counts = np.diff(starts)
    seq = np.repeat(np.arange(len(counts)), counts)
    causal = (context_lens.cpu().numpy() - counts)[seq] + np.arange(starts[-1]) - starts[seq] + 1
    row_len = np.maximum(causal, until.cpu().numpy())
    group_start = np.concatenate([s + np.arange(0, n, TILE) for s, n in zip(starts, counts)]
                                 + [starts[-1:]]).astype(np.int32)
    shared = np.minimum.reduceat(row_len, group_start[:-1]) // block_size
    return KernelRows(table, torch.from_numpy(seq.astype(np.int64)),
                      torch.from_numpy(row_len.astype(np.int64)),
                      torch.arange(starts[-1], dtype=torch.int32), torch.from_numpy(group_start),
                      torch.from_numpy(shared.astype(np.int32)),
                      torch.from_numpy(causal.astype(np.int64)))
