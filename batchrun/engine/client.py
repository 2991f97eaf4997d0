"""EngineClient: the engine interface the batch runner drives, written down once.

Three things implement it: the Engine itself (engine/engine.py, `batchrun run`), the
SyncEngineClient of a server's shared AsyncEngine (engine/sync_client.py, the Batches API), and
the tests' FakeEngine (tests/fake_engine.py). tests/unit/test_engine_client.py checks that all
three satisfy the Protocol with the same parameter names.

No torch here, so callers and fakes can type against it without loading model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from batchrun.engine.multimodal import MultiModalInputs
    from batchrun.engine.outputs import RequestOutput
    from batchrun.engine.sampling_params import SamplingParams


@dataclass
class EngineStats:
    """Counters of an engine since it started (a shared engine's: all of its callers')."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (recomputation included)
    computed_tokens: int = 0  # all tokens run through the model
    steps: int = 0
    num_preemptions: int = 0
    peak_kv_usage: float = 0.0  # fraction of the KV pool in use at its fullest
    num_kv_blocks: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@runtime_checkable
class EngineClient(Protocol):
    """Requests in by id, finished (or streamed) RequestOutputs out of step().

    The caller owns the loop: add requests, call step() while has_unfinished_requests(), and
    abort what it no longer wants. Only the caller's own requests are visible through a client.
    """

    # Read-only properties: an implementation may hold them as attributes or properties.
    @property
    def max_model_len(self) -> int:
        """Context length in tokens: prompt plus generated tokens of one request at most."""
        ...

    @property
    def stats(self) -> EngineStats:
        """The engine's counters (read-only for callers; the batch runner writes them into its
        metrics file)."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    stream: bool = False, priority: int | None = None,
                    multimodal: MultiModalInputs | None = None) -> None:
        """Queue a request for params.n choices under a unique request_id.

        Raises PromptTooLongError (batchrun.engine.errors) when the prompt, plus max_tokens,
        does not fit max_model_len, and ValueError for another request the engine refuses
        (duplicate id, empty prompt, n < 1). A client may instead report a refusal as a finished
        output with `error` set from a later step(). arrival_time (time.time()) is when the
        request arrived, for its latency metrics; default now. stream=True makes step() also
        return unfinished, cumulative outputs of each choice. Lower priority values are
        scheduled first; None is the client's default. `multimodal`: the prompt's images
        (engine.multimodal.MultiModalInputs) for a model that takes them.
        """
        ...

    def step(self) -> list[RequestOutput]:
        """Run the engine once; the outputs it produced. A finished output (`finished=True`)
        is the last one for its request id; it has `error` set, or a choice with finish_reason
        "abort", when the request failed. May block (a client of a shared engine waits for its
        own outputs) and may return nothing."""
        ...

    def abort_request(self, request_id: str) -> object:
        """Stop a request now and free what it holds; unknown or finished ids are ignored. No
        output of it is to be expected from step() afterwards. What it returns is
        implementation-specific (the Engine: the request's final output)."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether any request added through this client has not finished or been aborted."""
        ...
