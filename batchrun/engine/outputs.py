"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass, field



@dataclass
class PromptLogprobs:
    """Prompt logprobs (scoring) of a finished request; index j is prompt token j, entry 0 is
    None (engine/prompt_logprobs.py computes them)."""
    token_ids: list[int]
    logprob: list[float | None]
    rank: list[int | None]
    top: list[list[tuple[int, float]] | None]  # (token id, logprob), best first


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) of the most likely alternatives, best first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, stop token or stop string), "length" (max_tokens or context), "abort",
    # or None while still running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the engine failed this request (e.g. it can never fit in the KV pool).
    error: str | None = None
    # With SamplingParams.prompt_logprobs, on the finished output.
    prompt_logprobs: PromptLogprobs | None = None
    # With SamplingParams.pooling, on the finished output: the pooled vector (float32 values).
    embedding: list[float] | None = None
