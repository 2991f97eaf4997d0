"""What every attention backend shares: the step's row layout, the metadata base and the
backend interface.

The KV cache of a layer is a flat tensor of slots [num_blocks * block_size, kv_heads, head_dim];
slot = block_id * block_size + offset. A step's rows (tokens) are laid out sequence after
sequence, decodes (one row each) first, then prefill chunks; sequence i owns rows
query_start[i]:query_start[i + 1] and, after this step, sees context_lens[i] tokens read
through block_tables[i]. A model whose layers are in several KV groups (engine/kv_groups.py)
gets one metadata per group (GroupedMetadata); each layer reads its group's (layer_metadata).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, TypeVar

import torch


@dataclass
class StepLayout:
    """A step's rows as the runner laid them out; what a backend's builder reads."""
    slot_mapping: torch.Tensor  # [T] slot each row's K/V is written to
    positions: torch.Tensor  # [T] position of each row in its sequence
    block_tables: torch.Tensor  # [S, max_blocks] int64
    query_start: torch.Tensor  # [S + 1] first row of each sequence
    context_lens: torch.Tensor  # [S] tokens of context after this step (cached + new)
    block_size: int
    num_decode: int  # the first num_decode sequences are decodes (one row each)
    starts: list[int]  # [S] tokens of context before this step
    counts: list[int]  # [S] rows of each sequence
    host_tables: list[list[int]] | None = None  # block_tables' rows as the host built them

    @classmethod
    def of(cls, tables: list[list[int]], starts: list[int], counts: list[int], num_decode: int,
           block_size: int, device: torch.device) -> StepLayout:
        """The layout of sequences with block ids `tables`, starts[i] tokens of context before
        this step and counts[i] rows in it, laid out in this order."""
        count_t = torch.tensor(counts, device=device)
        start_t = torch.tensor(starts, device=device)
        seq = torch.repeat_interleave(torch.arange(len(counts), device=device), count_t)
        ends = torch.cumsum(count_t, 0)
        positions = (torch.arange(sum(counts), device=device) - (ends - count_t)[seq]
                     + start_t[seq])
        table, slots = _table_and_slots(tables, seq, positions, block_size)
        return cls(slot_mapping=slots, positions=positions, block_tables=table,
                   query_start=torch.cat([ends.new_zeros(1), ends]),
                   context_lens=start_t + count_t, block_size=block_size, num_decode=num_decode,
                   starts=starts, counts=counts, host_tables=tables)

    def through(self, tables: list[list[int]]) -> StepLayout:
        """The same rows read and written through other block tables (another KV group's)."""
        seq = torch.repeat_interleave(torch.arange(len(self.counts), device=self.positions.device),
                                      torch.tensor(self.counts, device=self.positions.device))
        table, slots = _table_and_slots(tables, seq, self.positions, self.block_size)
        return replace(self, block_tables=table, slot_mapping=slots, host_tables=tables)

    def metadata_fields(self) -> dict[str, Any]:
        """The AttentionMetadata base fields of this layout."""
        return dict(slot_mapping=self.slot_mapping, block_size=self.block_size,
                    block_tables=self.block_tables, query_start=self.query_start,
                    context_lens=self.context_lens, positions=self.positions)


def _table_and_slots(tables: list[list[int]], seq: torch.Tensor, positions: torch.Tensor,
                     bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-table tensor [S, max_blocks] and each row's slot."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                         device=positions.device)
    return table, table[seq, positions // bs] * bs + positions % bs


@dataclass
class AttentionMetadata:
    """The generic layout every backend's metadata carries (reference.py works on it alone)."""
    slot_mapping: torch.Tensor  # [T]
    block_size: int
    block_tables: torch.Tensor  # [S, max_blocks] int64
    query_start: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]
    positions: torch.Tensor  # [T]
    # [T] or None: a row also sees the keys of its sequence before position visible_until[row]
    # (0: none past its own position). The model sets it for image tokens that attend to each
    # other both ways (Gemma 3); the CPU kernels and the reference path (reference.py) read it,
    # paged_attention sends other backends' steps with it to the reference.
    visible_until: torch.Tensor | None = field(default=None, kw_only=True)


@dataclass
class GroupedMetadata:
    """A step's metadata for a model whose layers are in several KV groups (engine/kv_groups.py):
    one backend metadata per group, each over the group's block tables; `layer_metadata` finds
    a layer's. The fields every group shares are here too; the tables and slots are not."""
    groups: list[AttentionMetadata]
    layer_group: list[int]  # layer -> its group

    @property
    def context_lens(self) -> torch.Tensor:
        return self.groups[0].context_lens

    @property
    def positions(self) -> torch.Tensor:
        return self.groups[0].positions

    @property
    def query_start(self) -> torch.Tensor:
        return self.groups[0].query_start


def layer_metadata(meta: AttentionMetadata | GroupedMetadata, layer: int) -> AttentionMetadata:
    """The metadata layer `layer` attends with (the step's own when the model is one group)."""
    if isinstance(meta, GroupedMetadata):
        return meta.groups[meta.layer_group[layer]]
    return meta


@dataclass(frozen=True)
class BackendEnv:
    """What a backend may look at when the engine starts, to decide whether it runs here."""
    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    lib: Any = None  # the CPU kernels' ctypes library, None without one
    kernel_mode: str = "cascade"  # --attention-kernel ("cascade", "legacy"), or "invariant"


Meta = TypeVar("Meta", bound=AttentionMetadata)


class AttentionBackend(Protocol[Meta]):
    """A backend whose builder makes metadata of type Meta and whose forward reads it."""
    name: ClassVar[str]
    metadata_type: ClassVar[type[AttentionMetadata]]  # Meta itself (a ClassVar cannot name it)

    @classmethod
    def create(cls, env: BackendEnv) -> AttentionBackend[Meta] | None:
        """The backend for this engine, or None when it does not run here."""

    def build(self, layout: StepLayout) -> Meta:
        """The step's metadata (once per step, never per layer)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Meta, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k/v [T, Hkv, D] into the cache, attend q [T, H, D]; returns [T, H, D].
        window, softcap, sinks: as registry.paged_attention documents them."""
