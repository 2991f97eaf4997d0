"""A request inside the engine: its tokens, its KV blocks and where it stands; and the Group of
the n sequences a user request runs as.

The first sequence of a group prefills the prompt; the others fork from it once the prompt is
computed, sharing its full KV blocks, so the prompt is prefilled once whatever n is.
"""

from __future__ import annotations

import enum
import time

from batchrun.engine.detokenizer import IncrementalDetokenizer
from batchrun.engine.lora import cache_salt
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchrun.engine.pooling import PooledState
from batchrun.engine.prompt_logprobs import PromptScores
from batchrun.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    group: Group  # the engine's Group for the user request, set by Sequences.new_sequence

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, arrival_time: float | None = None, priority: int = 0,
                 index: int = 0):
        self.request_id = request_id  # unique per sequence: "<user id>" or "<user id>#<choice>"
        self.index = index  # which of the user request's n choices this sequence is
        self.detokenizer: IncrementalDetokenizer | None = None  # when text is needed step by step
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        self.adapter = params.lora  # the LoRA adapter's name; None = the base model
        self.cache_salt = cache_salt(params.lora)  # the parent hash of the first KV block
        # Prompt plus generated tokens: a preempted request recomputes all of them.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first admission; -1 = not yet admitted
        self.block_ids: list[list[int]] = []  # one block table per KV group (kv_cache.py)
        self.state_slot: int | None = None  # a stateful model's state slot (state_slots.py)
        # A prefix hit's state checkpoint, copied into state_slot before the next step runs, and
        # the checkpoints (position, slot, block hash) this step writes (state_checkpoints.py).
        self.state_source: int | None = None
        self.checkpoint_writes: list[tuple[int, int, bytes]] = []
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.prompt_hashes: list[bytes] | None = None  # of the prompt's full blocks, when needed
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # Prompt logprobs, on the sequence that prefills the prompt (forked choices share it).
        self.scores: PromptScores | None = None
        if params.prompt_logprobs is not None and index == 0:
            self.scores = PromptScores(self.prompt_token_ids, params.prompt_logprobs)
        # The pooled vector of an embedding request (engine/pooling.py).
        self.pooled: PooledState | None = None
        if params.pooling is not None and index == 0:
            self.pooled = PooledState(params.pooling, self.num_prompt_tokens)
        # This step also recomputes the position before num_computed_tokens (a prefix-cache hit
        # holds no logits for it) without writing its K/V.
        self.rescore = False
        # The request's images (engine/multimodal.py); None for text only.
        self.multimodal: MultiModalInputs | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


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
