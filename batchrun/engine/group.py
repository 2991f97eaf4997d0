"""A user request with n choices: the sequences the engine runs for it and what they produced.

The first sequence prefills the prompt; the others fork from it once the prompt is computed,
sharing its full KV blocks, so the prompt is prefilled once whatever n is.
"""

from __future__ import annotations

import dataclasses

from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.engine.request import Request
from batchrun.engine.sampling_params import SamplingParams


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 and choice 0 of n agree); others get their own stream."""
    if index == 0:
        return seed
    return (seed * 6364136223846793005 + index * 1442695040888963407) % (1 << 63)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=choice_seed(params.seed, index))


class Group:
    def __init__(self, request_id: str, n: int, stream: bool):
        self.request_id = request_id
        self.multimodal: MultiModalInputs | None = None  # the shared prompt's images
        self.n = n
        self.stream = stream
        self.members: list[Request] = []
        self.done: dict[int, CompletionOutput] = {}
        self.error: str | None = None

    @property
    def leader(self) -> Request:
        return self.members[0]

    @property
    def needs_fork(self) -> bool:
        return len(self.members) < self.n

    @property
    def finished(self) -> bool:
        return len(self.done) == self.n

    def live(self) -> list[Request]:
        return [m for m in self.members if m.index not in self.done]

    def output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        leader = self.leader
        scores = leader.scores
        prompt_logprobs = scores.output() if finished and scores is not None and scores.done \
            else None
        pooled = leader.pooled
        embedding = pooled.result() if finished and pooled is not None and pooled.done \
            and self.error is None else None
        return RequestOutput(self.request_id, leader.prompt_token_ids, outputs, finished=finished,
                             num_cached_tokens=max(leader.num_cached_tokens, 0),
                             metrics=leader.metrics, error=self.error if finished else None,
                             prompt_logprobs=prompt_logprobs, embedding=embedding)

    def final_output(self) -> RequestOutput:
        return self.output([self.done[i] for i in sorted(self.done)], finished=True)
