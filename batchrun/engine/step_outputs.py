"""What a step makes of its hidden states besides the sampled logits, one object per feature.

A feature says which rows of a request it reads (`span`, while step_batch.prepare_batch lays the
step out) and what it makes of those rows' final hidden states (`read`, after the model). A new
reader of hidden states is one class here and one entry in READERS: neither the batch layout
nor the runner changes.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from batchrun.engine.model import NativeModel
from batchrun.engine.prompt_logprobs import score_rows
from batchrun.engine.request import Request

# (request, first row, rows, first position or token) of a request's rows in the step.
Span = tuple[Request, int, int, int]


class HiddenReader(Protocol):
    name: ClassVar[str]

    def span(self, req: Request, row: int, first: int, n: int) -> Span | None:
        """The rows of `req` this feature reads: its n tokens from position `first` lie at
        rows row..row+n-1 (None: none)."""

    def read(self, model: NativeModel, spans: list[Span], hidden: torch.Tensor) -> list:
        """What the feature makes of its spans' hidden states (the model's final ones)."""


class PromptScores:
    """Prompt logprobs (echo / prompt_logprobs): row p scores prompt token p + 1; rows for
    entries already known (a recomputed prefix) are skipped."""

    name: ClassVar[str] = "scored"

    def span(self, req: Request, row: int, first: int, n: int) -> Span | None:
        if req.scores is None or req.scores.done:
            return None
        start = max(first, req.scores.filled - 1)
        last = min(first + n, req.num_prompt_tokens - 1)
        if last <= start:
            return None
        assert start == req.scores.filled - 1, "a gap in the prompt entries"
        return req, row + start - first, last - start, start + 1

    def read(self, model: NativeModel, spans: list[Span], hidden: torch.Tensor) -> list:
        """(request, first token scored, logprobs, ranks, top ids, top logprobs) a span."""
        scored = []
        for req, row, rows, first in spans:
            targets = torch.tensor(req.all_token_ids[first:first + rows])
            assert req.scores is not None  # span() takes scoring requests only
            scored.append((req, first) + score_rows(model.compute_logits, hidden[row:row + rows],
                                                    targets, req.scores.k))
        return scored


class Pooling:
    """Pooled vectors (embeddings, classification, scoring by token logits): every prompt row
    goes to the request's pooler; a head (or the LM head) reads the last position only."""

    name: ClassVar[str] = "pooled"

    def span(self, req: Request, row: int, first: int, n: int) -> Span | None:
        return None if req.pooled is None else (req, row, n, first)

    def read(self, model: NativeModel, spans: list[Span], hidden: torch.Tensor) -> list:
        for req, row, rows, first in spans:
            states = hidden[row:row + rows]
            pooled = req.pooled
            assert pooled is not None  # span() takes pooling requests only
            params = pooled.params
            if params.reads_logits:
                if first + rows < pooled.n:
                    continue
                last = states[-1:]
                states = model.classify(last) if params.head else \
                    model.compute_logits(last)[:, list(params.token_ids)]
                first = pooled.n - 1
            pooled.add(first, states)
        return []  # the pooler holds the result (Request.pooled)


READERS: tuple[HiddenReader, ...] = (PromptScores(), Pooling())
