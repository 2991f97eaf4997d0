"""The portable backend: decode gathers each sequence's KV blocks and calls torch SDPA with a
padding mask (narrowed to a layer's sliding window or attention chunk; soft-capped layers and
layers with attention sinks through reference.attend); prefill chunks as in chunks.py. Runs on
any device and any head shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from batchrun.engine.attention.base import AttentionMetadata, BackendEnv, StepLayout
from batchrun.engine.attention.chunks import PrefillChunk, plan_prefills, prefill_attention
from batchrun.engine.attention.kv_write import read_rows, write_kv
from batchrun.engine.attention.reach import first_visible
from batchrun.engine.attention.reference import attend


@dataclass
class SdpaMetadata(AttentionMetadata):
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [B, L] slots to read per decode sequence (padded)
    decode_bias: torch.Tensor | None = None  # [B, 1, 1, L] 0 where valid, -inf on padding
    decode_valid: torch.Tensor | None = None  # [B, L] bool: the positions each decode sees
    prefills: list[PrefillChunk] = field(default_factory=list)
    same_length: list[tuple[int, int, int]] = field(default_factory=list)
    lib: object = None  # the CPU kernels, for the K/V write only


class SdpaBackend:
    name: ClassVar[str] = "sdpa"
    metadata_type: ClassVar[type[AttentionMetadata]] = SdpaMetadata

    def __init__(self, dtype: torch.dtype, lib=None):
        self.dtype = dtype  # of the decode mask
        self.lib = lib

    @classmethod
    def create(cls, env: BackendEnv) -> SdpaBackend:
        return cls(env.dtype, env.lib if env.device.type == "cpu" else None)

    def build(self, layout: StepLayout) -> SdpaMetadata:
        meta = SdpaMetadata(**layout.metadata_fields(), num_decode=layout.num_decode,
                            lib=self.lib)
        b, bs = layout.num_decode, layout.block_size
        if b:
            ctx = layout.context_lens[:b]
            grid = torch.arange(int(ctx.max()), device=ctx.device)[None, :]
            valid = grid < ctx[:, None]
            slots = layout.block_tables[:b].gather(1, (grid // bs).expand(b, -1)) * bs + grid % bs
            meta.decode_slots = slots.masked_fill(~valid, 0)
            meta.decode_valid = valid
            meta.decode_bias = torch.zeros(valid.shape, device=ctx.device, dtype=self.dtype
                                           ).masked_fill(~valid, float("-inf"))[:, None, None, :]
        meta.prefills, meta.same_length = plan_prefills(layout)
        return meta

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: SdpaMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.lib)
        out = torch.empty_like(q)
        b = meta.num_decode
        if b:
            num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
            # The query heads of one KV group act as `group` query rows against that group's keys.
            qd = q[:b].view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
            assert meta.decode_slots is not None  # build sets it when the step has decodes
            kd = read_rows(k_cache, meta.decode_slots, q.dtype)  # [B, L, Hkv, D]
            vd = read_rows(v_cache, meta.decode_slots, q.dtype)
            if window is None and chunk is None and not softcap and sinks is None:
                od = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                                    attn_mask=meta.decode_bias, scale=scale)
            else:
                valid = meta.decode_valid
                assert valid is not None  # set with decode_slots
                lowest = first_visible(meta.context_lens[:b, None] - 1, window, chunk)
                if lowest is not None:
                    grid = torch.arange(valid.shape[1], device=valid.device)[None, :]
                    valid = valid & (grid >= lowest)
                od = attend(q[:b, None], kd, vd, valid[:, None], scale, softcap, sinks)
            out[:b] = od.reshape(b, num_heads, head_dim)
        if meta.prefills:
            prefill_attention(out, q, k, v, k_cache, v_cache, meta.prefills, meta.same_length,
                              scale, window, softcap, sinks, chunk)
        return out
