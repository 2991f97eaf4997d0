"""Random paged-attention steps for the attention kernel checks: sequences with a cached prefix
(written into a paged cache through shuffled block tables) and this step's rows, laid out as
the runner does (decodes first)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.attention.base import AttentionMetadata, StepLayout
from batchrun.engine.attention.kv_write import store_rows
from batchrun.engine.attention.reference import reference_attention


@dataclass
class Problem:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [slots, Hkv, D], the prefixes written
    v_cache: torch.Tensor
    layout: StepLayout
    scale: float

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the caches (each run writes the step's rows into its own)."""
        return self.k_cache.clone(), self.v_cache.clone()

    def reference(self, **extras) -> torch.Tensor:
        """reference_attention over the generic layout (extras: sliding_window, softcap, sinks)."""
        meta = AttentionMetadata(**self.layout.metadata_fields(),
                                 visible_until=extras.pop("visible_until", None))
        return reference_attention(self.q, self.k, self.v, *self.caches(), meta, self.scale,
                                   **extras)


def make_problem(device: torch.device, starts: list[int], counts: list[int], num_decode: int,
                 heads: int = 4, kv_heads: int = 2, dim: int = 16, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 shared: dict[int, int] | None = None) -> Problem:
    """Sequence i has starts[i] cached tokens and counts[i] rows in the step; the first
    num_decode are decodes (counts 1). shared {i: j}: sequence i's table starts with sequence
    j's first blocks (as many as both hold whole), a prefix-cache hit."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // block_size) for s, n in zip(starts, counts)]
    order = torch.randperm(sum(need) + 2, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    for i, j in (shared or {}).items():
        whole = min(starts[i], starts[j]) // block_size
        tables[i][:whole] = tables[j][:whole]
    slots = (sum(need) + 2) * block_size
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    k_cache, v_cache = (torch.zeros(slots, kv_heads, dim, dtype=dtype) for _ in range(2))
    prefix = StepLayout.of(tables, [0] * len(starts), starts, 0, block_size, torch.device("cpu"))
    store_rows(k_cache, prefix.slot_mapping, rand(sum(starts), kv_heads, dim))
    store_rows(v_cache, prefix.slot_mapping, rand(sum(starts), kv_heads, dim))
    rows = sum(counts)
    layout = StepLayout.of(tables, starts, counts, num_decode, block_size, device)
    return Problem(rand(rows, heads, dim).to(device), rand(rows, kv_heads, dim).to(device),
                   rand(rows, kv_heads, dim).to(device), k_cache.to(device), v_cache.to(device),
                   layout, dim ** -0.5)


def max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max())
