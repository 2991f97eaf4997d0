"""The CPU C kernels (kernels/paged_attention.c) reading KV blocks in place.

With cascade (the default), decode tokens are attended in groups that read the prefix blocks
they share once per step, and prefill chunks over a cached context by tiles (cascade.py plans
the rows once per step); a step where nothing is shared and no chunk has a cached context runs
the plain per-sequence decode kernel. `--attention-kernel legacy` keeps every decode on its own
and every prefill chunk on SDPA. Chunks the kernel leaves go to chunks.py.

A layer with a sliding window or attention chunk (reach.py), logit soft-capping or attention
sinks runs the same kernel (each row starts its walk where its window or chunk does, without
shared-prefix grouping; a sink joins each row's softmax sum at the end); its decodes go
through the grouped entry point even when the step has no groups. An ALiBi layer (BLOOM, Falcon: a slope per head times the key's distance added
to each score) runs the same kernel, grouping kept (the bias is per row, head and key). A
soft-capped, sink or ALiBi layer's fresh prefill chunks take the kernel too (in cascade mode):
SDPA can neither cap scores nor add a sink, and the dense fallback (reference.attend) builds
every [rows, context] score matrix in memory.
A step whose metadata sets visible_until (an image's tokens attend both ways: Gemma 3) puts
every row in the kernel, each row's walk ending at max(its position + 1, visible_until); a window
is still measured from the row's own position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from batchrun.engine.attention.base import AttentionMetadata, BackendEnv, StepLayout
from batchrun.engine.attention.cascade import (KernelRows, plan_rows, plan_seeing_ahead,
                                               supported)
from batchrun.engine.attention.chunks import PrefillChunk, plan_prefills, prefill_attention
from batchrun.engine.attention.int8_kv import INT8
from batchrun.engine.attention.kv_write import write_kv
from batchrun.engine.attention.reach import first_visible


@dataclass
class CpuKernelMetadata(AttentionMetadata):
    lib: object = None  # the ctypes library
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] int64, contiguous
    decode_lens: torch.Tensor | None = None  # [B] int64
    rows: KernelRows | None = None  # set: the kernel attends these rows (decode + some prefill)
    prefills: list[PrefillChunk] = field(default_factory=list)
    same_length: list[tuple[int, int, int]] = field(default_factory=list)
    masked_rows: KernelRows | None = None  # the rows of windowed / soft-capped layers (lazily)
    layout: StepLayout | None = None  # cascade mode: the step's, to plan every_chunk_rows from
    every_chunk_rows: KernelRows | None = None  # the step's rows and all its chunks' (lazily)
    ahead_rows: KernelRows | None = None  # every row, when visible_until is set (lazily)

    def rows_seeing_ahead(self) -> KernelRows:
        """Every row of the step in the kernel, each up to its visible_until (an image's rows
        see their whole image): built once per step, every layer reads it."""
        if self.ahead_rows is None:
            assert self.visible_until is not None  # forward asks only when it is set
            self.ahead_rows = plan_seeing_ahead(self.block_tables, self.query_start,
                                                self.context_lens, self.visible_until,
                                                self.block_size)
        return self.ahead_rows

    def rows_for_masked(self) -> KernelRows | None:
        """The kernel's rows for a layer with a window, soft-cap or sinks: the step's rows, or when
        the step runs the plain decode kernel, its decodes as groups of one."""
        if self.rows is not None or not self.num_decode:
            return self.rows
        if self.masked_rows is None:
            b = self.num_decode
            assert self.decode_tables is not None and self.decode_lens is not None  # with decodes
            self.masked_rows = KernelRows(
                self.decode_tables, torch.arange(b), self.decode_lens.contiguous(),
                torch.arange(b, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32),
                torch.zeros(b, dtype=torch.int32))
        return self.masked_rows

    def rows_for_sdpa_misfits(self) -> tuple[KernelRows | None, bool]:
        """The kernel rows of a layer SDPA cannot run (soft-capped, or with sinks), and whether
        every prefill chunk is among them (cascade mode, where the step has chunks)."""
        if self.layout is None or not self.prefills:
            return self.rows_for_masked(), False
        if all(chunk.in_kernel for chunk in self.prefills):
            return self.rows, True
        if self.every_chunk_rows is None:
            lay = self.layout
            self.every_chunk_rows = plan_rows(self.lib, lay.block_tables, lay.starts, lay.counts,
                                              self.num_decode, lay.block_size, every_chunk=True)[0]
        return self.every_chunk_rows, True


def kernel_attention(lib, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: KernelRows, block_size: int, scale: float, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     chunk: int | None = None, alibi: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The C kernel's attention for `rows` of q [T, H, D] over the paged cache, as float32
    [T, H, D] (rows outside the groups are left uninitialised). window: a row sees its last
    `window` positions only; chunk: a row sees its own attention chunk only; softcap: scores
    become softcap * tanh(score / softcap); sinks [H]: a logit per head that joins the
    softmax's denominator only; alibi [H]: ALiBi's slopes."""
    causal = rows.row_len if rows.causal_len is None else rows.causal_len
    first = first_visible(causal - 1, window, chunk)
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    alibi = None if alibi is None else alibi.detach().float().contiguous()
    ks, vs = (getattr(c, "row_scales", None) for c in (k_cache, v_cache))  # int8_kv.py
    return lib.paged_attention(q, k_cache, v_cache, rows, block_size, scale, first, softcap,
                               sinks, ks, vs, alibi)


def decode_attention(lib, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                     scale: float) -> torch.Tensor:
    """The plain decode kernel: q [B, H, D], one row per sequence; float32 [B, H, D]."""
    return lib.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale)


class CpuKernelBackend:
    name: ClassVar[str] = "cpu-kernel"
    metadata_type: ClassVar[type[AttentionMetadata]] = CpuKernelMetadata
    sees_ahead: ClassVar[bool] = True  # forward honours meta.visible_until
    takes_alibi: ClassVar[bool] = True  # forward takes ALiBi slopes

    def __init__(self, lib, cascade: bool = True):
        self.lib = lib
        self.cascade = cascade

    @classmethod
    def create(cls, env: BackendEnv) -> CpuKernelBackend | None:
        if env.device.type != "cpu" or env.lib is None or not supported(
                env.num_heads, env.num_kv_heads, env.head_dim, env.block_size):
            return None
        return cls(env.lib, cascade=env.kernel_mode == "cascade")

    def build(self, layout: StepLayout) -> CpuKernelMetadata:
        b = layout.num_decode
        meta = CpuKernelMetadata(**layout.metadata_fields(), lib=self.lib, num_decode=b)
        if b:
            meta.decode_tables = layout.block_tables[:b].contiguous()
            meta.decode_lens = layout.context_lens[:b]
        in_kernel = None
        if self.cascade:
            meta.layout = layout
            meta.rows, in_kernel = plan_rows(self.lib, layout.block_tables, layout.starts,
                                             layout.counts, b, layout.block_size)
        meta.prefills, meta.same_length = plan_prefills(layout, in_kernel)
        return meta

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: CpuKernelMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, chunk: int | None = None,
                alibi: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.lib)
        if meta.visible_until is not None:  # every row in the kernel, none to SDPA
            of = kernel_attention(meta.lib, q, k_cache, v_cache, meta.rows_seeing_ahead(),
                                  meta.block_size, scale, window, softcap, sinks, chunk, alibi)
            return of if of.dtype == q.dtype else of.to(q.dtype)
        every_chunk = False
        if softcap or sinks is not None or alibi is not None:
            rows, every_chunk = meta.rows_for_sdpa_misfits()
        else:
            # the plain decode kernel reads no row scales: an int8 cache's decodes take groups of one
            plain = window is None and chunk is None and k_cache.dtype != INT8
            rows = meta.rows if plain else meta.rows_for_masked()
        if rows is not None:
            of = kernel_attention(meta.lib, q, k_cache, v_cache, rows, meta.block_size, scale,
                                  window, softcap, sinks, chunk, alibi)
            out = of if of.dtype == q.dtype else of.to(q.dtype)
        else:
            out = torch.empty_like(q)
            b = meta.num_decode
            if b:
                assert meta.decode_tables is not None and meta.decode_lens is not None
                out[:b] = decode_attention(meta.lib, q[:b], k_cache, v_cache, meta.decode_tables,
                                           meta.decode_lens, meta.block_size, scale)
        if meta.prefills and not every_chunk:
            prefill_attention(out, q, k, v, k_cache, v_cache, meta.prefills, meta.same_length,
                              scale, window, softcap, sinks, chunk, alibi)
        return out
