"""Engine: the public face of the continuous-batching engine (API skeleton; internals land next)."""

from __future__ import annotations

from typing import Sequence

from batchrun.config import EngineConfig
from batchrun.engine.outputs import RequestOutput
from batchrun.engine.sampling_params import SamplingParams


class Engine:
    """Synchronous engine. Typical loop:

        engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=64))
        while engine.has_unfinished_requests():
            for out in engine.step():      # outputs of requests that finished in this step
                ...

    add_request raises PromptTooLongError (a ValueError) when the prompt (plus at least one
    generated token) cannot fit in max_model_len.
    """

    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, arrival_time: float | None = None) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...

    def abort_request(self, request_id: str) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order."""
        ...


class PromptTooLongError(ValueError):
    pass
