"""Attention over the paged KV cache.

On the CPU a small C kernel reads KV blocks in place (kernels/paged_attention.c): decode tokens,
grouped so that sequences sharing prefix blocks read them once per step (cascade), and prefill
chunks over a cached context (`KernelRows`). Elsewhere, or without a compiler, decode gathers
the blocks and calls SDPA. The KV cache of a layer is a flat tensor of slots
[num_blocks * block_size, kv_heads, head_dim]; slot = block_id * block_size + offset. A step's
tokens are laid out decode tokens first (one per sequence), then the prefill chunks. Fresh
prefill chunks (no cached context) come sorted by length, so a run of them of one length is one
batched causal SDPA call over views of the step's rows (an embedding run's many short prompts
would otherwise cost a call each per layer). A prefill chunk the kernel does not take is one
SDPA call with a causal mask offset by its cached context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchrun.engine.kernels import kind


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk's first token in the step's flat row
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached prefix + chunk)
    slots: torch.Tensor | None  # [ctx_len] KV slots to read; None when the chunk is its whole context
    batched: bool = False  # in one of AttentionMetadata.same_length runs
    in_kernel: bool = False  # attended by the C kernel through KernelRows (slots unused)


def same_length_runs(prefills: list[PrefillChunk]) -> list[tuple[int, int, int]]:
    """(first row, chunks, length) of each run of 2+ adjacent fresh chunks (no cached context)
    of one length; marks those chunks `batched`."""
    runs, current = [], []
    for chunk in prefills:
        if chunk.slots is not None or chunk.in_kernel:
            continue
        if current and (chunk.q_len != current[0].q_len
                        or chunk.q_start != current[-1].q_start + current[-1].q_len):
            runs.append(current)
            current = []
        current.append(chunk)
    runs.append(current)
    runs = [r for r in runs if len(r) > 1]
    for run in runs:
        for chunk in run:
            chunk.batched = True
    return [(r[0].q_start, len(r), r[0].q_len) for r in runs]


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

    @property
    def groups(self) -> int:
        return self.group_shared.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot each token's K/V is written to
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [B, L] slots to read per decode sequence (padded)
    decode_bias: torch.Tensor | None = None  # [B, 1, 1, L] 0 where valid, -inf on padding
    # For the in-place CPU kernel instead of decode_slots/decode_bias:
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] int64 block tables
    decode_lens: torch.Tensor | None = None  # [B] int64 context lengths
    kernel: object = None  # the ctypes library (CPU)
    triton: bool = False  # use the Triton kernel (CUDA)
    block_size: int = 16
    prefills: list[PrefillChunk] = field(default_factory=list)
    same_length: list[tuple[int, int, int]] = field(default_factory=list)  # same_length_runs
    rows: KernelRows | None = None  # set: the kernel attends these rows (decode + some prefill)
    # The step's layout for attention code that reads the cache itself (sliding window, ...):
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int64, sequences in step order
    query_start: torch.Tensor | None = None  # [S + 1] first row of each sequence's tokens
    context_lens: torch.Tensor | None = None  # [S] context after this step
    positions: torch.Tensor | None = None  # [T]


def kernel_attention(lib, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: KernelRows, block_size: int, scale: float) -> torch.Tensor:
    """The C kernel's attention for `rows` of q [T, H, D] over the paged cache, as float32
    [T, H, D] (rows outside the groups are left uninitialised)."""
    qf = q.float().contiguous()  # the kernel computes in float32 whatever the model's dtype
    of = torch.empty_like(qf)
    rc = lib.paged_attention(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.tables.data_ptr(),
        rows.tables.shape[1], rows.row_table.data_ptr(), rows.row_len.data_ptr(), of.data_ptr(),
        q.shape[1], k_cache.shape[1], q.shape[2], block_size, scale, kind(k_cache.dtype),
        torch.get_num_threads(), rows.groups, rows.order.data_ptr(), rows.group_start.data_ptr(),
        rows.group_shared.data_ptr())
    assert rc == 0, "paged_attention failed"
    return of


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for this step's tokens; returns [T, H, D]."""
    if meta.kernel is not None and k.stride()[1:] == v.stride()[1:] == (k.shape[2], 1) \
            and k.stride(0) == v.stride(0):
        meta.kernel.kv_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                             meta.slot_mapping.data_ptr(), k.shape[0], k.stride(0),
                             k.shape[1] * k.shape[2], kind(k.dtype), kind(k_cache.dtype))
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)

    if meta.rows is not None:
        of = kernel_attention(meta.kernel, q, k_cache, v_cache, meta.rows, meta.block_size, scale)
        out = of if of.dtype == q.dtype else of.to(q.dtype)
    elif meta.num_decode and meta.decode_tables is not None and not meta.triton:
        b = meta.num_decode
        qd = q[:b].float().contiguous()  # the kernel computes in float32 whatever the model's dtype
        od = torch.empty_like(qd)
        rc = meta.kernel.paged_decode_attention(
            qd.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.decode_tables.data_ptr(),
            meta.decode_lens.data_ptr(), od.data_ptr(), b, num_heads, num_kv_heads, head_dim,
            meta.block_size, meta.decode_tables.shape[1], scale, kind(k_cache.dtype),
            torch.get_num_threads())
        assert rc == 0, "paged_decode_attention failed"
        out[:b] = od
    elif meta.num_decode and meta.triton:
        from batchrun.engine.kernels.triton_decode import paged_decode_attention

        b = meta.num_decode
        out[:b] = paged_decode_attention(q[:b].contiguous(), k_cache, v_cache, meta.decode_tables,
                                         meta.decode_lens, meta.block_size, scale)
    elif meta.num_decode:
        b = meta.num_decode
        # The query heads of one KV group act as `group` query rows against that group's keys.
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        kd = k_cache[meta.decode_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        vd = v_cache[meta.decode_slots].to(q.dtype).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_bias, scale=scale)
        out[:b] = od.reshape(b, num_heads, head_dim)

    for s, count, n in meta.same_length:
        shape = (count, n)
        qg = q[s:s + count * n].view(*shape, num_heads, head_dim).transpose(1, 2)  # [B, H, n, D]
        kg = k[s:s + count * n].view(*shape, num_kv_heads, head_dim).transpose(1, 2)
        vg = v[s:s + count * n].view(*shape, num_kv_heads, head_dim).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale,
                                            enable_gqa=group > 1)
        out[s:s + count * n] = og.transpose(1, 2).reshape(count * n, num_heads, head_dim)
    for chunk in meta.prefills:
        if chunk.batched or chunk.in_kernel:
            continue
        s, n = chunk.q_start, chunk.q_len
        qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.slots is None:
            kp, vp = k[s:s + n], v[s:s + n]
            mask, causal = None, True
        else:
            kp = k_cache[chunk.slots].to(q.dtype)
            vp = v_cache[chunk.slots].to(q.dtype)
            q_pos = torch.arange(chunk.ctx_len - n, chunk.ctx_len, device=q.device)
            mask = torch.arange(chunk.ctx_len, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=causal,
                                            scale=scale, enable_gqa=group > 1)
        out[s:s + n] = op[0].transpose(0, 1)
    return out
