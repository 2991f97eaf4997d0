"""CUDA graphs for decode steps at a few padded batch sizes.

A decode step launches hundreds of small kernels; replaying a captured graph removes the launch
overhead that dominates a small model on a big GPU. Inputs are copied into static buffers; rows
past the real batch are padding: they write their K/V into a scratch slot no request owns and
have context length 0, so attention skips them.
"""

from __future__ import annotations

import torch

from batchrun.engine.attention import StepLayout
from batchrun.engine.attention.cuda_triton import TritonMetadata

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks: int, block_size: int,
                 scratch_slot: int, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.sizes = [s for s in SIZES if s < max_batch] + [max_batch]
        n = max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros((n, max_blocks), dtype=torch.long, device=device)
        self.lens = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start = torch.arange(n + 1, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels)
                self._forward(size)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)

    def _forward(self, size: int) -> torch.Tensor:
        meta = TritonMetadata(slot_mapping=self.slots[:size], block_size=self.block_size,
                              block_tables=self.tables[:size],
                              query_start=self.query_start[:size + 1],
                              context_lens=self.lens[:size], positions=self.positions[:size],
                              num_decode=size, decode_tables=self.tables[:size],
                              decode_lens=self.lens[:size])
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def takes(self, batch) -> bool:
        """Whether a step_batch.StepBatch is one of the captured steps: decodes only, no
        hidden-state readers, no adapter rows (graphs are captured without them), no images (the
        model takes them as an argument the graph has not), few enough."""
        b = batch.layout.num_decode
        return (0 < b <= self.max_batch and batch.decode_only and not batch.reads_hidden
                and not batch.adapter_slots and not batch.images)

    def run(self, layout: StepLayout, tokens: list[int]) -> torch.Tensor:
        """The logits of a decode-only step's rows."""
        input_ids = torch.tensor(tokens, device=self.input_ids.device)
        positions, slots = layout.positions, layout.slot_mapping
        tables, lens = layout.block_tables, layout.context_lens
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.tables[:b, :tables.shape[1]].copy_(tables)
        self.lens[:b].copy_(lens)
        if size > b:
            self.slots[b:size].fill_(self.scratch_slot)
            self.lens[b:size].zero_()
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b]
