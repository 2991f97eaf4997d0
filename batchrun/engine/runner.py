"""Model runner: turns a scheduled step into one flat forward pass over the paged KV cache."""

from __future__ import annotations

import torch

import importlib.util

from batchrun.engine import cascade, kernels
from batchrun.engine.attention import AttentionMetadata, PrefillChunk, same_length_runs
from batchrun.engine.lora import segments
from batchrun.engine.multimodal import StepImages
from batchrun.engine.prompt_logprobs import score_rows
from batchrun.engine.request import Request


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype | None = None, max_num_seqs: int = 64,
                 max_model_len: int = 2048, cuda_graphs: bool = True, adapters=None,
                 attention_kernel: str = "cascade"):
        cfg = model.config
        self.model = model
        self.adapters = adapters  # engine.lora.AdapterSlots, or None
        self.device = device
        self.block_size = block_size
        self.dtype = dtype
        kv_ok = str(kv_dtype or dtype) in kernels.KINDS
        self.kernel = kernels.library(kernels.shape_flags(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)) if device.type == "cpu" and kv_ok \
            else None
        self.triton = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        # Cascade decode groups and prefill chunks in the kernel (engine/cascade.py); "legacy"
        # keeps each decode sequence on its own and prefill chunks on SDPA.
        # The attention kernel takes these shapes (else decode gathers the blocks for SDPA; the
        # other kernels, kv_write among them, run whatever the shape).
        self.attention_in_kernel = self.kernel is not None and cascade.supported(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
        self.cascade = self.attention_in_kernel and attention_kernel == "cascade"
        # One block more than the pool hands out: padding rows of CUDA graphs write into it.
        shape = ((num_blocks + 1) * block_size, cfg.num_kv_heads, cfg.head_dim)
        # Also where a recomputed position whose K/V is already cached writes (Request.rescore).
        self.scratch_slot = num_blocks * block_size
        kv_dtype = kv_dtype or dtype
        # torch.empty: pages are only touched (and counted in RSS) as blocks get used.
        self.kv_caches = [(torch.empty(shape, dtype=kv_dtype, device=device),
                           torch.empty(shape, dtype=kv_dtype, device=device))
                          for _ in range(cfg.num_layers)]
        self.graphs = None
        if self.triton and cuda_graphs:
            from batchrun.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv_caches, max_num_seqs,
                                       -(-max_model_len // block_size), block_size,
                                       num_blocks * block_size, device)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for k, v in self.kv_caches:
            k[dst * bs:(dst + 1) * bs] = k[src * bs:(src + 1) * bs]
            v[dst * bs:(dst + 1) * bs] = v[src * bs:(src + 1) * bs]

    def _adapter_slots(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        """The slot of each adapter in this step's work (resident: the engine activated them)."""
        if self.adapters is None:
            return {}
        names = {r.adapter for r, _ in work if r.adapter is not None}
        return {name: self.adapters.slot_of(name) for name in names}

    @torch.inference_mode()
    def execute(self, work: list[tuple[Request, int]]
                ) -> tuple[torch.Tensor, list[Request], list[tuple]]:
        """Compute the scheduled tokens; returns logits [N, V] for the N requests that sample,
        and the prompt entries computed for requests that score their prompt: (request, first
        token scored, logprobs, ranks, top ids, top logprobs) each."""
        # Decodes (one new token on top of computed context) first, then prefill chunks.
        def is_decode(r: Request, n: int) -> bool:
            return n == 1 and r.num_computed_tokens == r.num_tokens - 1 and not r.rescore

        decodes = [(r, n) for r, n in work if is_decode(r, n)]
        # Fresh prompts sorted by length: runs of one length share an attention call.
        prefills = sorted((w for w in work if not is_decode(*w)),
                          key=lambda w: (w[0].num_computed_tokens > 0 or w[0].rescore, w[1]))
        slot_of = self._adapter_slots(work)
        if slot_of:  # rows of one adapter together (a stable sort: by length within each)
            decodes.sort(key=lambda w: slot_of.get(w[0].adapter, -1))
            prefills.sort(key=lambda w: slot_of.get(w[0].adapter, -1))
        ordered = decodes + prefills
        dev, bs = self.device, self.block_size

        tokens: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        scoring: list[tuple[Request, int, int, int]] = []  # (req, first row, rows, first token)
        scratch_rows: list[int] = []
        pooling: list[tuple[Request, int, int, int]] = []  # (req, first row, rows, first position)
        images: list[StepImages] = []  # rows of requests with images, for the model
        for req, n in ordered:
            c = req.num_computed_tokens
            if req.rescore:
                scratch_rows.append(len(tokens))
                c, n = c - 1, n + 1
            if req.scores is not None and not req.scores.done:
                # Row p scores prompt token p + 1; rows for known entries are skipped.
                first = max(c, req.scores.filled - 1)
                last = min(c + n, req.num_prompt_tokens - 1)
                if last > first:
                    assert first == req.scores.filled - 1, "a gap in the prompt entries"
                    scoring.append((req, len(tokens) + first - c, last - first, first + 1))
            if req.pooled is not None:
                pooling.append((req, len(tokens), n, c))
            if req.multimodal is not None:
                images.append(StepImages(req.multimodal, len(tokens), c, n))
            tokens.extend(req.all_token_ids[c:c + n])
            starts.append(c)
            counts.append(n)
            tables.append(req.block_ids)
            if c + n == req.num_tokens and req.max_tokens > 0:
                sample_rows.append(len(tokens) - 1)
                samplers.append(req)

        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        count_t = torch.tensor(counts, device=dev)
        req_idx = torch.repeat_interleave(torch.arange(len(ordered), device=dev), count_t)
        first_row = torch.cumsum(count_t, 0) - count_t
        positions = (torch.arange(len(tokens), device=dev) - first_row[req_idx]
                     + torch.tensor(starts, device=dev)[req_idx])
        slot_mapping = table[req_idx, positions // bs] * bs + positions % bs
        if scratch_rows:
            slot_mapping[torch.tensor(scratch_rows, device=dev)] = self.scratch_slot

        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode=len(decodes),
                                 kernel=self.kernel, block_size=bs, block_tables=table,
                                 query_start=torch.cumsum(torch.tensor([0] + counts), 0).to(dev),
                                 context_lens=torch.tensor(starts, device=dev) + count_t,
                                 positions=positions)
        if decodes and (self.attention_in_kernel or self.triton):
            meta.decode_tables = table[:len(decodes)].contiguous()
            meta.decode_lens = torch.tensor([starts[i] + 1 for i in range(len(decodes))], device=dev)
            meta.triton = self.triton
            if self.graphs is not None and not prefills and not pooling and not slot_of \
                    and not images \
                    and len(decodes) <= self.graphs.max_batch:
                logits = self.graphs.run(torch.tensor(tokens, device=dev), positions, slot_mapping,
                                         meta.decode_tables, meta.decode_lens)
                return logits, samplers, []
        elif decodes:
            ctx = torch.tensor([starts[i] + 1 for i in range(len(decodes))], device=dev)
            grid = torch.arange(int(ctx.max()), device=dev)[None, :]
            valid = grid < ctx[:, None]
            slots = table[:len(decodes)].gather(1, (grid // bs).expand(len(decodes), -1)) * bs + grid % bs
            meta.decode_slots = slots.masked_fill(~valid, 0)
            meta.decode_bias = torch.zeros(valid.shape, device=dev, dtype=self.dtype).masked_fill(
                ~valid, float("-inf"))[:, None, None, :]
        in_kernel = [False] * len(prefills)
        if self.cascade:
            meta.rows, in_kernel = cascade.plan_rows(self.kernel, table, starts, counts,
                                                     len(decodes), bs)
        row = len(decodes)
        for i in range(len(decodes), len(ordered)):
            c, n = starts[i], counts[i]
            slots = None
            if in_kernel[i - len(decodes)]:
                meta.prefills.append(PrefillChunk(row, n, c + n, None, in_kernel=True))
                row += n
                continue
            if c > 0:
                pos = torch.arange(c + n, device=dev)
                slots = table[i, pos // bs] * bs + pos % bs
            meta.prefills.append(PrefillChunk(q_start=row, q_len=n, ctx_len=c + n, slots=slots))
            row += n
        meta.same_length = same_length_runs(meta.prefills)

        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        if slot_of:
            rows = [slot_of.get(r.adapter, -1) for (r, _), n in zip(ordered, counts) for _ in range(n)]
            self.adapters.set_segments(segments(rows))
        try:
            if images:
                hidden = self.model(input_ids, positions, self.kv_caches, meta, images=images)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
        finally:
            if slot_of:
                self.adapters.set_segments([])
        for req, row, rows, first in pooling:
            req.pooled.add(first, hidden[row:row + rows])
        scored = []
        for req, row, rows, first in scoring:
            c = first - 1  # the position of the first scored row
            targets = torch.tensor(req.all_token_ids[c + 1:c + 1 + rows])
            scored.append((req, first) + score_rows(self.model.compute_logits,
                                                    hidden[row:row + rows], targets,
                                                    req.scores.k))
        if not sample_rows:
            return hidden.new_empty((0, 0)), [], scored
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        return logits, samplers, scored
