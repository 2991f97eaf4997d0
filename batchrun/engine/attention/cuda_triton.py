"""CUDA: decode tokens by the Triton kernel (kernels/triton_decode.py), which reads context
lengths on the device, so decode-only steps can be captured as CUDA graphs
(engine/cuda_graphs.py); prefill chunks as in chunks.py. Layers with a sliding window, logit
soft-capping or attention sinks take reference_attention."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from batchrun.engine.attention.base import AttentionMetadata, BackendEnv, StepLayout
from batchrun.engine.attention.chunks import PrefillChunk, plan_prefills, prefill_attention
from batchrun.engine.attention.kv_write import write_kv
from batchrun.engine.attention.reference import reference_attention


@dataclass
class TritonMetadata(AttentionMetadata):
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] int64, contiguous
    decode_lens: torch.Tensor | None = None  # [B] int64
    prefills: list[PrefillChunk] = field(default_factory=list)
    same_length: list[tuple[int, int, int]] = field(default_factory=list)


class TritonBackend:
    name: ClassVar[str] = "triton"
    metadata_type: ClassVar[type[AttentionMetadata]] = TritonMetadata

    @classmethod
    def create(cls, env: BackendEnv) -> TritonBackend | None:
        if env.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            return cls()
        return None

    def build(self, layout: StepLayout) -> TritonMetadata:
        b = layout.num_decode
        meta = TritonMetadata(**layout.metadata_fields(), num_decode=b)
        if b:
            meta.decode_tables = layout.block_tables[:b].contiguous()
            meta.decode_lens = layout.context_lens[:b]
        meta.prefills, meta.same_length = plan_prefills(layout)
        return meta

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TritonMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if window is not None or softcap or sinks is not None:
            return reference_attention(q, k, v, k_cache, v_cache, meta, scale,
                                       sliding_window=window, softcap=softcap, sinks=sinks)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        b = meta.num_decode
        if b:
            from batchrun.engine.kernels.triton_decode import paged_decode_attention

            assert meta.decode_tables is not None and meta.decode_lens is not None  # with decodes

            out[:b] = paged_decode_attention(q[:b].contiguous(), k_cache, v_cache,
                                             meta.decode_tables, meta.decode_lens,
                                             meta.block_size, scale)
        if meta.prefills:
            prefill_attention(out, q, k, v, k_cache, v_cache, meta.prefills, meta.same_length,
                              scale)
        return out
