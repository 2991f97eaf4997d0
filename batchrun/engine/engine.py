"""Engine: requests in, one scheduled forward pass per step, finished outputs out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from batchrun.config import EngineConfig
from batchrun.engine.detokenizer import IncrementalDetokenizer
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from batchrun.engine.request import Request, Status
from batchrun.engine.runner import ModelRunner
from batchrun.engine.sampler import Sampler
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.scheduler import Scheduler


class PromptTooLongError(ValueError):
    pass


@dataclass
class EngineStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill + decode + recompute)
    steps: int = 0
    num_preemptions: int = 0
    peak_kv_usage: float = 0.0  # fraction of the KV pool in use at its fullest
    num_kv_blocks: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["cache_hit_rate"] = self.cache_hit_rate
        return d


class Engine:
    """Synchronous continuous-batching engine. Typical loop:

        engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=64))
        while engine.has_unfinished_requests():
            for out in engine.step():      # outputs of requests that finished in this step
                ...
    """

    def __init__(self, model, tokenizer, config: EngineConfig, eos_token_ids: Sequence[int],
                 device: torch.device, dtype: torch.dtype, num_blocks: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        bs = config.cache.block_size
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(model, num_blocks, bs, device, dtype)
        self.sampler = Sampler(device)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.streaming: set[str] = set()
        self.stats = EngineStats(num_kv_blocks=num_blocks)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    stream: bool = False, priority: int = 0) -> None:
        """Queue a request. With stream=True, step() also returns an unfinished, cumulative
        RequestOutput for it after every step that gave it a token (text holds back a tail that
        could still become a stop string). Lower priority values are scheduled first."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if params.n != 1:
            raise ValueError("n > 1 is not supported by the engine yet")
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; the model's context length is "
                f"{self.max_model_len}, leaving no room to generate")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise PromptTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context length of {self.max_model_len} tokens")
        req = Request(request_id, list(prompt_token_ids), params, max_tokens, arrival_time, priority)
        self.requests[request_id] = req
        if stream:
            self.streaming.add(request_id)
        if params.stop or stream:
            self.detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, params.stop, params.skip_special_tokens)
        self.scheduler.add(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, "abort")

    def step(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        plan = self.scheduler.schedule()
        for req in plan.rejected:
            finished.append(self._finish(req, "abort", error=(
                f"the request needs {self.kv.blocks_needed(req.num_tokens)} KV blocks but the "
                f"pool holds {self.kv.num_blocks}; raise --kv-cache-memory")))
        if not plan.work:
            return finished
        now = time.time()
        for req, _ in plan.work:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        logits, samplers = self.runner.execute(plan.work)
        self.stats.steps += 1
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for req, n in plan.work:
            req.num_computed_tokens += n
            self.stats.computed_tokens += n
            self.kv.cache_full_blocks(req)
        if samplers:
            out = self.sampler(logits, [r.params for r in samplers], [r.request_id for r in samplers])
            now = time.time()
            for req, token, lp in zip(samplers, out.token_ids, out.logprobs):
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.all_token_ids.append(token)
                if lp is not None:
                    req.logprobs.append(TokenLogprob(token, lp[0], lp[1]))
                reason = self._check_stop(req, token)
                if reason is not None:
                    finished.append(self._finish(req, reason))
                elif req.request_id in self.streaming:
                    finished.append(self._snapshot(req))
        self.stats.peak_kv_usage = self.kv.peak_used / self.kv.num_blocks
        return finished

    def _check_stop(self, req: Request, token: int) -> str | None:
        p = req.params
        detok = self.detokenizers.get(req.request_id)
        if req.num_output_tokens > p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if detok is not None:
                stop = detok.add(token)
                if stop is not None:
                    req.stop_reason = stop
                    return "stop"
        elif detok is not None:
            detok.add(token)

        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _snapshot(self, req: Request) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        completion = CompletionOutput(index=0, text=detok.stable_text(), token_ids=req.output_token_ids,
                                      logprobs=req.logprobs)
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], finished=False,
                             num_cached_tokens=max(req.num_cached_tokens, 0), metrics=req.metrics)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(req)
        self.sampler.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self.streaming.discard(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = time.time()
        output_ids = req.output_token_ids
        detok = self.detokenizers.pop(req.request_id, None)
        if detok is not None:
            text = detok.text if req.stop_reason is not None and isinstance(req.stop_reason, str) \
                else detok.flush()
        else:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=req.params.skip_special_tokens)
        cached = max(req.num_cached_tokens, 0)
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += req.num_prompt_tokens
        self.stats.cached_tokens += cached
        self.stats.generation_tokens += len(output_ids)
        completion = CompletionOutput(index=0, text=text, token_ids=output_ids, finish_reason=reason,
                                      stop_reason=req.stop_reason, logprobs=req.logprobs)
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], finished=True,
                             num_cached_tokens=cached, metrics=req.metrics, error=error)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [f"gen-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
