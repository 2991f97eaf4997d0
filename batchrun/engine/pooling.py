"""Pooling (embeddings): a prefill-only request whose result is one vector made from the
model's final hidden states (the output of the final norm) over its prompt.

    SamplingParams(max_tokens=0, pooling=PoolingParams("mean"))

`last` takes the last prompt position (what decoder-only embedding models are trained for, and
vLLM's default for them), `mean` averages every position, `cls` takes the first. `normalize`
scales the vector to unit L2 norm. `head` (with `last`, not normalised) hands the last
position's hidden state to the model's sequence-classification head (`model.classify`, applied
by the runner): the result is that head's logits, as transformers' *ForSequenceClassification
gives them. `token_ids` (with `last`, not normalised) reads a causal LM as a classifier: the
result is the LM head's logits of those vocabulary tokens at the last position (a yes/no
reranker such as Qwen3-Reranker scores with the pair).

The prefix cache keeps K/V, not hidden states. `last` is computed at the last prompt token,
which a cache hit never covers (the last token is always computed), so a `last` request takes
cached blocks like any other. `mean` and `cls` need hidden states of positions a hit would skip,
so those requests take no cached blocks (Scheduler): they compute every position, and the
vector never depends on what the cache held. Their blocks are still cached for others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    pooling: PoolingType = "last"
    normalize: bool = True
    head: bool = False  # the model's classification head's logits instead of the hidden state
    token_ids: tuple[int, ...] = ()  # these tokens' logits instead of the hidden state

    def __post_init__(self):
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling!r}")
        if self.head and self.token_ids:
            raise ValueError("a pooled request reads the classification head or token logits, "
                             "not both")
        if self.reads_logits and (self.pooling != "last" or self.normalize):
            raise ValueError("a classification head reads the last position, not normalised")

    @property
    def reads_logits(self) -> bool:
        """Whether the result is logits of the last position (a head's, or the tokens')."""
        return self.head or bool(self.token_ids)

    @property
    def needs_all_positions(self) -> bool:
        """Whether positions before the last are needed (so a prefix-cache hit cannot serve)."""
        return self.pooling != "last"


class PooledState:
    """One request's pooled vector, built chunk by chunk as its prompt is computed."""

    def __init__(self, params: PoolingParams, num_prompt_tokens: int):
        self.params = params
        self.n = num_prompt_tokens
        self.acc: torch.Tensor | None = None  # float32 [hidden]: the sum, first or last row
        self.upto = 0  # positions accumulated (mean / cls)

    def add(self, start: int, hidden: torch.Tensor) -> None:
        """The final hidden states of prompt positions start .. start + len(hidden) - 1."""
        kind = self.params.pooling
        end = start + hidden.shape[0]
        if kind == "last":
            if end == self.n:
                self.acc = hidden[-1].float().cpu()
            return
        if start == 0:  # a fresh start (or recomputing after preemption)
            self.acc, self.upto = None, 0
        assert start == self.upto, "pooled positions must be computed in order"
        if kind == "cls":
            if start == 0:
                self.acc = hidden[0].float().cpu()
        else:
            part = hidden.float().sum(dim=0).cpu()
            self.acc = part if self.acc is None else self.acc + part
        self.upto = end

    @property
    def done(self) -> bool:
        if self.params.pooling == "last":
            return self.acc is not None
        return self.upto >= self.n and self.acc is not None

    def result(self) -> list[float]:
        v = self.acc
        assert v is not None  # asked once done
        if self.params.pooling == "mean":
            v = v / self.n
        if self.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()
