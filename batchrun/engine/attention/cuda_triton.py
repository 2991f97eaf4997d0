"""CUDA: every row of a step attended by Triton kernels reading the paged cache in place.

Decode tokens take kernels/triton_decode.py (one program per sequence and KV head), or for long
contexts with few sequences the split-K kernel (kernels/triton_splitk.py, its split count a
function of the launch's shapes alone); both read context lengths on the device, so decode-only
steps are captured as CUDA graphs (engine/cuda_graphs.py). Decodes that share leading blocks
(a common system prompt, n > 1 samples) read them once per group (kernels/triton_cascade.py,
planned once per step on the host from the layout's block tables; not for windowed layers, not
in captured graphs; --attention-kernel legacy turns it off). Prefill chunks, fresh or over a
cached prefix, take kernels/triton_prefill.py, which reads the chunk's own K/V back from the
cache (written first) and the prefix where it lies. Sliding windows, logit soft-capping,
attention sinks and fp8 e4m3 caches run in those kernels (registry.paged_attention folds an fp8
cache's layer scales into the scale and the output, fp8_kv.py); a step with visible_until (an
image's rows see each other both ways, Gemma 3) runs every row through the prefill kernel.
ALiBi slopes too (BLOOM, Falcon, MPT): registry.paged_attention hands them to this backend
(takes_alibi) instead of the reference.

What still takes reference_attention on CUDA: an int8 cache, whose per-row scales no Triton
kernel reads (kv_sizing refuses --kv-cache-dtype int8 on CUDA, so only a caller passing one
reaches it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import torch

from batchrun.engine.attention.base import AttentionMetadata, BackendEnv, StepLayout
from batchrun.engine.attention.int8_kv import INT8
from batchrun.engine.attention.kv_write import write_kv
from batchrun.engine.attention.reference import reference_attention


@dataclass
class TritonMetadata(AttentionMetadata):
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] int64, contiguous
    decode_lens: torch.Tensor | None = None  # [B] int64
    max_prefill_rows: int | None = None  # the longest chunk's rows (None: read from query_start)
    max_rows: int | None = None  # the most rows of any sequence (visible_until steps)
    decode_splits: int | None = None  # split-K shares of decodes (None: choose from the shapes)
    shared: Any = None  # triton_cascade.SharedPrefixes of the decodes, or None


@lru_cache(maxsize=None)
def _programs(device_index: int) -> int:
    """About two programs per SM: what a decode launch needs to fill the GPU."""
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


class TritonBackend:
    name: ClassVar[str] = "triton"
    metadata_type: ClassVar[type[AttentionMetadata]] = TritonMetadata
    sees_ahead: ClassVar[bool] = True  # forward honours meta.visible_until
    takes_alibi: ClassVar[bool] = True  # forward takes alibi slopes

    def __init__(self, cascade: bool = True):
        self.cascade = cascade

    @classmethod
    def create(cls, env: BackendEnv) -> TritonBackend | None:
        if env.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            return cls(cascade=env.kernel_mode == "cascade")
        return None

    def build(self, layout: StepLayout) -> TritonMetadata:
        b = layout.num_decode
        meta = TritonMetadata(**layout.metadata_fields(), num_decode=b,
                              max_prefill_rows=max(layout.counts[b:], default=0),
                              max_rows=max(layout.counts, default=0))
        if b:
            meta.decode_tables = layout.block_tables[:b].contiguous()
            meta.decode_lens = layout.context_lens[:b]
        if self.cascade and b > 1 and layout.host_tables is not None:
            from batchrun.engine.kernels.triton_cascade import plan_shared_prefixes

            meta.shared = plan_shared_prefixes(layout.host_tables[:b],
                                               [n + 1 for n in layout.starts[:b]],
                                               layout.block_size, layout.block_tables.device)
        return meta

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TritonMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None,
                alibi: torch.Tensor | None = None) -> torch.Tensor:
        if k_cache.dtype == INT8:
            return reference_attention(q, k, v, k_cache, v_cache, meta, scale,
                                       sliding_window=window, softcap=softcap, sinks=sinks,
                                       alibi=alibi)
        from batchrun.engine.kernels.triton_prefill import paged_prefill_attention

        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        extras: dict[str, Any] = dict(window=window, softcap=softcap, sinks=sinks, alibi=alibi)
        seqs = meta.context_lens.shape[0]
        if meta.visible_until is not None:
            rows = meta.max_rows if meta.max_rows is not None else _most_rows(meta, 0)
            paged_prefill_attention(q, k_cache, v_cache, out, meta.block_tables, meta.query_start,
                                    meta.context_lens, range(seqs), rows, meta.block_size, scale,
                                    visible_until=meta.visible_until, **extras)
            return out
        b = meta.num_decode
        if b:
            out[:b] = _decode(q[:b], k_cache, v_cache, meta, scale, **extras)
        if seqs > b:
            most = meta.max_prefill_rows
            paged_prefill_attention(q, k_cache, v_cache, out, meta.block_tables, meta.query_start,
                                    meta.context_lens, range(b, seqs),
                                    most if most is not None else _most_rows(meta, b),
                                    meta.block_size, scale, **extras)
        return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata,
            scale: float, window: int | None, softcap: float | None,
            sinks: torch.Tensor | None, alibi: torch.Tensor | None) -> torch.Tensor:
    """The decode rows' attention: the plain kernel, or split-K where the shapes call for it."""
    from batchrun.engine.kernels.triton_decode import paged_decode_attention
    from batchrun.engine.kernels.triton_splitk import choose_splits, splitk_decode_attention

    tables, lens = meta.decode_tables, meta.decode_lens
    assert tables is not None and lens is not None  # set wherever there are decodes
    splits = meta.decode_splits
    if splits is None:
        context = tables.shape[1] * meta.block_size
        if window is not None:
            context = min(context, window)
        splits = choose_splits(q.shape[0], k_cache.shape[1], context, meta.block_size,
                               _programs(q.device.index or 0)) if q.is_cuda else 1
    if meta.shared is not None and window is None:
        from batchrun.engine.kernels.triton_cascade import cascade_decode_attention

        return cascade_decode_attention(q, k_cache, v_cache, tables, lens, meta.block_size, scale,
                                        meta.shared, splits, softcap, sinks, alibi=alibi)
    if splits > 1:
        return splitk_decode_attention(q, k_cache, v_cache, tables, lens, meta.block_size, scale,
                                       splits, window, softcap, sinks, alibi=alibi)
    return paged_decode_attention(q, k_cache, v_cache, tables, lens, meta.block_size, scale,
                                  window, softcap, sinks, alibi=alibi)


def _most_rows(meta: TritonMetadata, first: int) -> int:
    """The most rows of sequences first.. (a host read: metadata not made by build)."""
    return int((meta.query_start[first + 1:] - meta.query_start[first:-1]).max())
