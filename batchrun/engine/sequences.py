"""The user requests in the engine (a Group of n sequences each): creating their sequences,
finishing them and building what is reported for them."""

from __future__ import annotations

import logging
import time

from batchrun.engine.client import EngineStats
from batchrun.engine.detokenizer import IncrementalDetokenizer
from batchrun.engine.group import choice_params
from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.engine.request import Group, Request, Status
from batchrun.engine.sampler import Sampler
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Sequences:
    def __init__(self, tokenizer, scheduler: Scheduler, sampler: Sampler, stats: EngineStats):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.stats = stats
        self.groups: dict[str, Group] = {}  # by user request id, until finished

    def new_sequence(self, group: Group, index: int, tokens: list[int], params: SamplingParams,
                     max_tokens: int, arrival_time, priority: int) -> Request:
        rid = group.request_id if index == 0 else f"{group.request_id}#{index}"
        req = Request(rid, tokens, choice_params(params, index), max_tokens, arrival_time,
                      priority, index)
        req.group = group
        req.multimodal = group.multimodal  # the shared prompt's images, on every choice
        if params.stop or group.stream:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, tokens, params.stop,
                                                     params.skip_special_tokens)
        group.members.append(req)
        return req

    def completion(self, req: Request, partial: bool = False) -> CompletionOutput:
        detok = req.detokenizer
        if partial:  # streamed: a streamed request always has a detokenizer
            assert detok is not None
            text = detok.stable_text()
        elif detok is not None:
            text = detok.text if isinstance(req.stop_reason, str) else detok.flush()
        else:
            text = self.tokenizer.decode(req.output_token_ids,
                                         skip_special_tokens=req.params.skip_special_tokens)
        return CompletionOutput(index=req.index, text=text, token_ids=req.output_token_ids,
                                finish_reason=None if partial else req.finish_reason,
                                stop_reason=None if partial else req.stop_reason,
                                logprobs=req.logprobs)

    def finish(self, req: Request, reason: str) -> list[RequestOutput]:
        """Finish one sequence; returns what to report (the group's output once all n are done)."""
        self.scheduler.finish(req)
        self.sampler.forget(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = time.time()
        group = req.group
        group.done[req.index] = self.completion(req)
        self.stats.generation_tokens += req.num_output_tokens
        if reason == "abort" and group.needs_fork:
            return self.finish_group(group, "abort")
        if group.finished:
            return [self._close(group)]
        if group.stream:
            return [group.output([group.done[req.index]], finished=False)]
        return []

    def finish_group(self, group: Group, reason: str) -> list[RequestOutput]:
        for req in group.live():
            self.scheduler.finish(req)
            self.sampler.forget(req.request_id)
            req.status = Status.FINISHED
            req.finish_reason = reason
            try:
                group.done[req.index] = self.completion(req)
            except Exception:  # the detokenizer that failed this request: report no text
                group.done[req.index] = CompletionOutput(
                    index=req.index, text="", token_ids=req.output_token_ids,
                    finish_reason=reason, logprobs=req.logprobs)
            self.stats.generation_tokens += req.num_output_tokens
        for index in range(len(group.members), group.n):  # never forked
            group.done[index] = CompletionOutput(index=index, text="", token_ids=[], finish_reason=reason)
        return [self._close(group)]

    def fail_group(self, group: Group, stage: str, exc: Exception) -> list[RequestOutput]:
        """End one request with an error; the engine and every other request go on."""
        if group.request_id not in self.groups:
            return []
        log.error("request %s failed while %s: %s: %s", group.request_id, stage,
                  type(exc).__name__, exc, exc_info=exc)
        group.error = f"internal error while {stage}: {type(exc).__name__}: {exc}"
        return self.finish_group(group, "abort")

    def _close(self, group: Group) -> RequestOutput:
        self.groups.pop(group.request_id, None)
        leader = group.leader
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += leader.num_prompt_tokens
        self.stats.cached_tokens += max(leader.num_cached_tokens, 0)
        return group.final_output()
