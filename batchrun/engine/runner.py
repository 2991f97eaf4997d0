"""Model runner: one scheduled step is one flat forward pass over the paged KV cache.

prepare (the rows, step_batch.py) -> the attention backend's metadata (chosen once at start-up,
engine/attention/) -> the model -> the outputs wanted of its hidden states: each reader's
(step_outputs.py: prompt scores, pooled vectors) and the logits of the rows that sample. Decode-only steps on CUDA replay a captured
graph instead (cuda_graphs.py; models of one KV group only). A model whose layers are in several
KV groups (kv_groups.py) gets one metadata per group, and its layers of different groups share
the cache tensors. A model that keeps recurrent state (state_slots.py) gets the state tensors
of `num_state_slots` slots here (and `num_checkpoints` more, its state checkpoints:
state_checkpoints.py) and each step's StepState beside the metadata (no CUDA graphs): a
sequence starting from a prefix hit first gets its checkpoint copied into its slot.
"""

from __future__ import annotations

import torch

from batchrun.engine import kernels
from batchrun.engine.attention import fp8_kv, int8_kv
from batchrun.engine.attention import (AttentionMetadata, BackendEnv, GroupedMetadata,
                                       StepLayout, select_backend)
from batchrun.engine.kv_groups import KVGroups, kv_groups
from batchrun.engine.model import KeepsState, NativeModel, TakesImages
from batchrun.engine.model_output import ModelOutput
from batchrun.engine.request import Request
from batchrun.engine.state_checkpoints import StepCheckpoints
from batchrun.engine.state_slots import StepState, copy_slot, state_tensors
from batchrun.engine.step_batch import StepBatch, prepare_batch
from batchrun.engine.step_outputs import READERS


class ModelRunner:
    def __init__(self, model: NativeModel, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype | None = None, max_num_seqs: int = 64,
                 max_model_len: int = 2048, cuda_graphs: bool = True, adapters=None,
                 attention_kernel: str = "cascade", groups: KVGroups | None = None,
                 kv_scales: torch.Tensor | None = None, num_state_slots: int = 0,
                 num_checkpoints: int = 0):
        cfg = model.config
        self.groups = groups or kv_groups(cfg)
        self.model = model
        self.adapters = adapters  # engine.lora.AdapterSlots, or None
        self.device = device
        self.block_size = block_size
        self.dtype = dtype
        kv_dtype = kv_dtype or dtype
        lib = kernels.library(kernels.shape_flags(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)) \
            if device.type == "cpu" and str(kv_dtype) in kernels.KINDS and cfg.num_layers \
            else None  # a model without attention layers (Mamba) needs no attention kernels
        self.states = state_tensors(model.state_spec, num_state_slots + num_checkpoints, device) \
            if isinstance(model, KeepsState) else []
        # --attention-kernel legacy keeps each decode sequence on its own and prefill chunks
        # on SDPA (attention/cpu_kernel.py).
        self.attention = select_backend(BackendEnv(
            device, dtype, kv_dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
            lib, attention_kernel))
        # One block more than the pool hands out: padding rows of CUDA graphs write into it.
        shape = ((num_blocks + 1) * block_size, cfg.num_kv_heads, cfg.head_dim)
        # Also where a recomputed position whose K/V is already cached writes (Request.rescore).
        self.scratch_slot = num_blocks * block_size
        # torch.empty: pages are only touched (and counted in RSS) as blocks get used.
        self.tensors = [(torch.empty(shape, dtype=kv_dtype, device=device),
                         torch.empty(shape, dtype=kv_dtype, device=device))
                        for _ in range(self.groups.layers_per_block)]
        # Each layer's K/V cache: a pool block belongs to one group at a time, so the layers of
        # different groups share the tensors (kv_groups.py).
        placement = self.groups.placement()
        self.kv_caches = [self.tensors[placement[layer][1]] for layer in range(cfg.num_layers)]
        self.row_scales = []  # an int8 cache's per (slot, KV head) K and V scales, per tensor pair
        if kv_dtype == int8_kv.INT8:
            self.row_scales = [tuple(torch.empty(shape[:2], device=device) for _ in range(2))
                               for _ in self.tensors]
            self.kv_caches = [int8_kv.layer_caches(*self.tensors[t], *self.row_scales[t])
                              for _, t in (placement[layer] for layer in range(cfg.num_layers))]
        if kv_dtype == fp8_kv.FP8:  # kv_scales [layers, 2]: each layer's K and V scale
            if kv_scales is None:
                raise ValueError("an fp8 KV cache needs its layers' scales (kv_scales)")
            self.kv_caches = [fp8_kv.layer_caches(k, v, *kv_scales[layer].tolist())
                              for layer, (k, v) in enumerate(self.kv_caches)]
        self.layer_group = [placement[layer][0] for layer in range(cfg.num_layers)]
        self.graphs = None
        if self.attention.name == "triton" and cuda_graphs and len(self.groups.groups) == 1 \
                and not self.states:
            from batchrun.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv_caches, max_num_seqs,
                                       -(-max_model_len // block_size), block_size,
                                       num_blocks * block_size, device)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for k, v in self.tensors + self.row_scales:
            k[dst * bs:(dst + 1) * bs] = k[src * bs:(src + 1) * bs]
            v[dst * bs:(dst + 1) * bs] = v[src * bs:(src + 1) * bs]

    @torch.inference_mode()
    def copy_state(self, src: int, dst: int) -> None:
        copy_slot(self.states, src, dst)

    @torch.inference_mode()
    def execute(self, work: list[tuple[Request, int]]) -> ModelOutput:
        """Compute the scheduled tokens (request, tokens to compute) of one step."""
        batch = self.prepare(work)
        if self.graphs is not None and self.graphs.takes(batch):
            return ModelOutput(self.graphs.run(batch.layout, batch.tokens), batch.samplers)
        hidden = self.run_model(batch, self.metadata(batch))
        read = {reader.name: reader.read(self.model, batch.spans[reader.name], hidden)
                for reader in READERS}
        return ModelOutput(self.logits(batch, hidden), batch.samplers, read["scored"])

    def metadata(self, batch: StepBatch) -> AttentionMetadata | GroupedMetadata:
        """The backend's metadata of the step: one per KV group when the model has several."""
        if len(batch.group_layouts) == 1:
            return self.attention.build(batch.layout)
        return GroupedMetadata([self.attention.build(layout) for layout in batch.group_layouts],
                               self.layer_group)

    def prepare(self, work: list[tuple[Request, int]]) -> StepBatch:
        return prepare_batch(work, self.block_size, self.scratch_slot, self.adapter_slots(work),
                             self.device)

    def adapter_slots(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        """The slot of each adapter in this step's work (resident: the engine activated them)."""
        if self.adapters is None:
            return {}
        names = {r.adapter for r, _ in work if r.adapter is not None}
        return {name: self.adapters.slot_of(name) for name in names}

    def run_model(self, batch: StepBatch, meta: AttentionMetadata | GroupedMetadata
                  ) -> torch.Tensor:
        """The final hidden states [T, hidden] of the step's rows."""
        layout: StepLayout = batch.layout
        input_ids = torch.tensor(batch.tokens, dtype=torch.long, device=self.device)
        extra: dict = {}  # models without images or state keep their signature
        if batch.images:
            assert isinstance(self.model, TakesImages)  # add_request refuses images otherwise
            extra["images"] = batch.images
        if isinstance(self.model, KeepsState) and self.states:  # (a VLM's: both, Qwen3.5)
            extra["state"] = self.step_state(batch)
        if batch.adapter_slots:
            self.adapters.set_segments(batch.adapter_segments())
        try:
            return self.model(input_ids, layout.positions, self.kv_caches, meta, **extra)
        finally:
            if batch.adapter_slots:
                self.adapters.set_segments([])

    def step_state(self, batch: StepBatch) -> StepState:
        slots = [r.state_slot for r in batch.requests]
        assert None not in slots  # the KV cache manager gave each a slot with its blocks
        checkpoints = StepCheckpoints()
        for i, (req, start) in enumerate(zip(batch.requests, batch.layout.starts)):
            if req.state_source is not None:  # a prefix hit: the state where the hit ends
                copy_slot(self.states, req.state_source, req.state_slot)  # type: ignore[arg-type]
                req.state_source = None
            for position, slot, _ in req.checkpoint_writes:
                checkpoints.seq.append(i)
                checkpoints.rows.append(position - start)
                checkpoints.slots.append(slot)
        return StepState.of(self.states, slots, batch.layout.starts,  # type: ignore[arg-type]
                            batch.layout.counts, self.device, checkpoints)

    def logits(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        if not batch.sample_rows:
            return hidden.new_empty((0, 0))
        rows = torch.tensor(batch.sample_rows, device=self.device)
        return self.model.compute_logits(hidden[rows])
