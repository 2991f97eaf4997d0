"""--batch-invariant attention: every token of a step, decode or prefill, is attended on its
own by the C kernel over the paged cache, after its K/V is written there. Rows that share
leading blocks (decode sequences on one cached prefix, the tokens of a prefill chunk) still
read those blocks from memory once for their group, but each row is scored as it would be alone
(KernelRows.per_row): the few-shot workload keeps most of what shared-prefix decoding saves.

A token's numbers then depend only on its own query and the KV of its context: not on the
other rows of the step, on whether its context came from a prefix-cache hit, an earlier chunk
or this one (the other backends take fresh chunks through SDPA, cached contexts through tiles
or gathers, shared prefixes through grouped GEMMs, each summing in its own order), nor on how
the rows are split across threads (each row is summed by one thread, block tile by block tile
from position 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from batchrun.engine.attention.base import AttentionMetadata, BackendEnv, StepLayout
from batchrun.engine.attention.cascade import KernelRows, plan_rows, supported
from batchrun.engine.attention.cpu_kernel import kernel_attention
from batchrun.engine.attention.kv_write import write_kv

MODE = "invariant"  # BackendEnv.kernel_mode that selects this backend


@dataclass
class InvariantMetadata(AttentionMetadata):
    lib: object = None
    rows: KernelRows | None = None


class InvariantBackend:
    name: ClassVar[str] = "cpu-invariant"
    metadata_type: ClassVar[type[AttentionMetadata]] = InvariantMetadata
    takes_alibi: ClassVar[bool] = True  # a row's ALiBi bias depends on its own position only

    def __init__(self, lib):
        self.lib = lib

    @classmethod
    def create(cls, env: BackendEnv) -> InvariantBackend | None:
        if env.kernel_mode != MODE:
            return None
        if env.device.type != "cpu" or env.lib is None or not supported(
                env.num_heads, env.num_kv_heads, env.head_dim, env.block_size):
            raise RuntimeError(
                "--batch-invariant needs the CPU attention kernel (a C compiler, float32/float16/"
                f"bfloat16 KV, head_dim a multiple of 16); this engine has device "
                f"{env.device.type}, head_dim {env.head_dim}, kernel "
                f"{'built' if env.lib is not None else 'unavailable'}")
        return cls(env.lib)

    def build(self, layout: StepLayout) -> InvariantMetadata:
        kernel_rows, _ = plan_rows(self.lib, layout.block_tables.contiguous(), layout.starts,
                                   layout.counts, layout.num_decode, layout.block_size,
                                   every_chunk=True)
        assert kernel_rows is not None  # every_chunk: every row of the step
        kernel_rows.per_row = True
        return InvariantMetadata(**layout.metadata_fields(), lib=self.lib, rows=kernel_rows)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: InvariantMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, chunk: int | None = None,
                alibi: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.lib)
        assert meta.rows is not None  # build always plans them
        of = kernel_attention(meta.lib, q, k_cache, v_cache, meta.rows, meta.block_size, scale,
                              window, softcap, sinks, chunk, alibi)
        return of if of.dtype == q.dtype else of.to(q.dtype)
