"""A step's rows, laid out once: which request owns which rows, the attention layout, and the
rows whose outputs are wanted (sampling; and each hidden-state reader's spans, step_outputs.py).

Decodes (one new token on top of computed context) come first, then prefill chunks: fresh
prompts sorted by length (runs of one length share an attention call), then chunks over a
cached context. With LoRA adapters, the rows of one adapter are kept together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchrun.engine.attention import StepLayout
from batchrun.engine.kv_cache import readable_table
from batchrun.engine.lora import segments
from batchrun.engine.multimodal import StepImages
from batchrun.engine.request import Request
from batchrun.engine.step_outputs import READERS, Span


@dataclass
class StepBatch:
    requests: list[Request]  # in row order
    layout: StepLayout
    tokens: list[int]  # [T] input ids
    sample_rows: list[int]  # rows whose logits are sampled, one per sampling request...
    samplers: list[Request]  # ...these
    spans: dict[str, list[Span]]  # each hidden-state reader's rows (step_outputs.READERS)
    adapter_slots: dict[str, int]  # the slot of each adapter in the step
    # The rows of requests with images (engine/multimodal.py), for the model; [] for text only.
    images: list[StepImages] = field(default_factory=list)
    # The layout through each KV group's block tables (engine/kv_groups.py); layout is group 0's.
    group_layouts: list[StepLayout] = field(default_factory=list)

    @property
    def reads_hidden(self) -> bool:
        """Whether a reader other than sampling wants rows of this step."""
        return any(self.spans.values())

    @property
    def decode_only(self) -> bool:
        return self.layout.num_decode == len(self.requests)

    def adapter_segments(self) -> list:
        rows = [adapter_slot(self.adapter_slots, r.adapter)
                for r, n in zip(self.requests, self.layout.counts) for _ in range(n)]
        return segments(rows)


def adapter_slot(slots: dict[str, int], adapter: str | None) -> int:
    """The slot of an adapter's rows; -1: the base model's (or an adapter not resident)."""
    return -1 if adapter is None else slots.get(adapter, -1)


def is_decode(req: Request, n: int) -> bool:
    return n == 1 and req.num_computed_tokens == req.num_tokens - 1 and not req.rescore


def row_order(work: list[tuple[Request, int]], adapter_slots: dict[str, int]
              ) -> tuple[list[tuple[Request, int]], int]:
    """The work in row order, and how many of it are decodes."""
    decodes = [(r, n) for r, n in work if is_decode(r, n)]
    prefills = sorted((w for w in work if not is_decode(*w)),
                      key=lambda w: (w[0].num_computed_tokens > 0 or w[0].rescore, w[1]))
    if adapter_slots:  # rows of one adapter together (a stable sort: by length within each)
        decodes.sort(key=lambda w: adapter_slot(adapter_slots, w[0].adapter))
        prefills.sort(key=lambda w: adapter_slot(adapter_slots, w[0].adapter))
    return decodes + prefills, len(decodes)


def prepare_batch(work: list[tuple[Request, int]], block_size: int, scratch_slot: int,
                  adapter_slots: dict[str, int], device: torch.device) -> StepBatch:
    ordered, num_decode = row_order(work, adapter_slots)
    tokens: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    tables: list[list[list[int]]] = []  # [sequence][group] block ids
    sample_rows: list[int] = []
    samplers: list[Request] = []
    spans: dict[str, list[Span]] = {reader.name: [] for reader in READERS}
    scratch_rows: list[int] = []
    images: list[StepImages] = []
    for req, n in ordered:
        c = req.num_computed_tokens
        if req.rescore:
            scratch_rows.append(len(tokens))
            c, n = c - 1, n + 1
        for reader in READERS:
            if (span := reader.span(req, len(tokens), c, n)) is not None:
                spans[reader.name].append(span)
        if req.multimodal is not None:
            images.append(StepImages(req.multimodal, len(tokens), c, n))
        tokens.extend(req.all_token_ids[c:c + n])
        starts.append(c)
        counts.append(n)
        tables.append([readable_table(t) for t in req.block_ids])
        if c + n == req.num_tokens and req.max_tokens > 0:
            sample_rows.append(len(tokens) - 1)
            samplers.append(req)
    layout = StepLayout.of([t[0] for t in tables], starts, counts, num_decode, block_size, device)
    layouts = [layout] + [layout.through([t[g] for t in tables])
                          for g in range(1, len(tables[0]))]
    if scratch_rows:
        # The recomputed position's K/V is already cached: write it where no request reads.
        for group_layout in layouts:
            group_layout.slot_mapping[torch.tensor(scratch_rows, device=device)] = scratch_slot
    return StepBatch([r for r, _ in ordered], layout, tokens, sample_rows, samplers, spans,
                     adapter_slots, images, layouts)
