"""How far back a layer's query rows see: the whole causal context, a sliding window of W
positions (p - W < j <= p), or a chunk of C positions (Llama 4's chunked local attention: j in
[p - p % C, p], the query's own chunk). Both narrow the context to a lower bound per row; every
backend applies it through `first_visible`."""

from __future__ import annotations

import torch


def first_visible(positions: torch.Tensor, window: int | None,
                  chunk: int | None) -> torch.Tensor | None:
    """The earliest key position each query at `positions` sees (None: position 0)."""
    first = None
    if window is not None:
        first = (positions - window + 1).clamp(min=0)
    if chunk is not None:
        start = positions - positions % chunk
        first = start if first is None else torch.maximum(first, start)
    return first


def reach(window: int | None, chunk: int | None) -> int | None:
    """The most positions a row sees (its own included); None: unbounded."""
    spans = [s for s in (window, chunk) if s is not None]
    return min(spans) if spans else None
