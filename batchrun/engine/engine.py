"""Engine: requests in, one scheduled forward pass per step, outputs out."""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from batchrun.engine.client import EngineStats
from batchrun.engine.detokenizer import IncrementalDetokenizer
from batchrun.engine.errors import PromptTooLongError
from batchrun.engine.group import Group, choice_params
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.lora import AdapterSlots
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from batchrun.engine.request import Request, Status
from batchrun.engine.runner import ModelRunner
from batchrun.engine.sampler import Sampler
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.scheduler import Scheduler
from batchrun.options.engine import EngineConfig

log = logging.getLogger(__name__)


class Engine:
    """Synchronous continuous-batching engine (a batchrun.engine.client.EngineClient). Typical loop:

        engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=64))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished: ...
    """

    def __init__(self, model, tokenizer, config: EngineConfig, eos_token_ids: Sequence[int],
                 device: torch.device, dtype: torch.dtype, num_blocks: int, max_model_len: int,
                 kv_dtype: torch.dtype | None = None, adapters: AdapterSlots | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        bs = config.cache.block_size
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching)
        # LoRA adapters served on this model (engine/lora.py); None = none.
        self.adapters = adapters
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   adapters.max_loras if adapters is not None else None)
        self.runner = ModelRunner(model, num_blocks, bs, device, dtype, kv_dtype,
                                  config.scheduler.max_num_seqs, max_model_len,
                                  cuda_graphs=config.device.cuda_graphs, adapters=adapters,
                                  attention_kernel=config.device.attention_kernel)
        self.sampler = Sampler(device, tokenizer, self.eos_token_ids)
        self.groups: dict[str, Group] = {}
        self.stats = EngineStats(num_kv_blocks=num_blocks)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    stream: bool = False, priority: int | None = None,
                    multimodal: MultiModalInputs | None = None) -> None:
        """Queue a request for params.n choices. The finished RequestOutput holds all n.

        `multimodal`: the prompt's images (engine/multimodal.py), placed by the model's
        place_images; a model without one refuses them.

        With stream=True, step() also returns unfinished RequestOutputs carrying one choice
        each, cumulative, after every step that gave that choice a token (text holds back a tail
        that could still become a stop string). Lower priority values are scheduled first
        (None: 0). See batchrun.engine.client.EngineClient.
        """
        priority = 0 if priority is None else priority
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if params.n < 1:
            raise ValueError("n must be at least 1")
        if params.lora is not None and (self.adapters is None or not self.adapters.known(params.lora)):
            raise ValueError(f"unknown LoRA adapter {params.lora!r}")
        if params.pooling is not None and (params.max_tokens != 0 or params.n != 1):
            raise ValueError("a pooling request is prefill-only: it needs max_tokens=0 and n=1")
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        room = self.max_model_len - prompt_len
        if room < 0 or (room == 0 and params.max_tokens != 0):
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; the model's context length is "
                f"{self.max_model_len}, leaving no room to generate")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise PromptTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context length of {self.max_model_len} tokens")
        if multimodal is not None:
            place = getattr(self.runner.model, "place_images", None)
            if place is None:
                raise ValueError("this model takes text only; the request has images")
            place(list(prompt_token_ids), multimodal)
        group = Group(request_id, params.n, stream)
        group.multimodal = multimodal
        leader = self._new_sequence(group, 0, list(prompt_token_ids), params, max_tokens,
                                    arrival_time, priority)
        self.groups[request_id] = group
        self.scheduler.add(leader)

    def _new_sequence(self, group: Group, index: int, tokens: list[int], params: SamplingParams,
                      max_tokens: int, arrival_time, priority: int) -> Request:
        rid = group.request_id if index == 0 else f"{group.request_id}#{index}"
        req = Request(rid, tokens, choice_params(params, index), max_tokens, arrival_time,
                      priority, index)
        req.group = group
        req.multimodal = group.multimodal
        if params.stop or group.stream:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, tokens, params.stop,
                                                     params.skip_special_tokens)
        group.members.append(req)
        return req

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still in the engine (waiting, running or preempted)."""
        return bool(self.groups)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        return self._finish_group(group, "abort")[0]

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass; the finished (and, for streamed requests,
        partial) outputs it produced."""
        outputs: list[RequestOutput] = []
        plan = self.scheduler.schedule()
        for req in plan.rejected:
            req.group.error = (f"the request needs {self.kv.blocks_needed(req.num_tokens)} KV "
                               f"blocks but the pool holds {self.kv.num_blocks}; raise --kv-cache-memory")
            outputs += self._finish_group(req.group, "abort")
        if self.adapters is not None and plan.work:
            work = self._activate_adapters(plan.work, outputs)
            plan.work[:] = work
        if not plan.work:
            return outputs
        now = time.time()
        for req, _ in plan.work:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        logits, samplers, scored = self.runner.execute(plan.work)
        self.stats.steps += 1
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for req, first, *entries in scored:
            req.scores.put(first, *entries)
        prompt_only = []
        for req, n in plan.work:
            self.stats.prefill_tokens += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
            req.num_computed_tokens += n
            self.stats.computed_tokens += n + req.rescore
            req.rescore = False
            self.kv.cache_full_blocks(req)
            if req.scores is not None:
                self._publish_scores(req)
            if req.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
                prompt_only.append(req)
        for req in prompt_only:  # max_tokens=0: the prompt is all there is to compute
            outputs += self._finish_group(req.group, "length")
        if samplers:
            samplers, rows = self._fork_groups(samplers)
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows, device=logits.device)]
            now = time.time()
            for req, sampled in zip(samplers, self._sample(logits, samplers)):
                if req.status == Status.FINISHED:
                    continue  # a sibling's failure already ended its group
                if isinstance(sampled, Exception):
                    outputs += self._fail_group(req.group, "sampling", sampled)
                    continue
                try:
                    self.sampler.accept(req, sampled[0])
                    outputs += self._append_token(req, *sampled, now)
                except Exception as exc:  # a grammar or detokenizer failure ends this request only
                    outputs += self._fail_group(req.group, "decoding", exc)
        self.stats.peak_kv_usage = self.kv.peak_used / self.kv.num_blocks
        return outputs

    def _activate_adapters(self, work: list[tuple[Request, int]],
                           outputs: list[RequestOutput]) -> list[tuple[Request, int]]:
        """Make the running requests' adapters resident; the work of requests whose adapter
        could not be loaded is dropped and those requests end with the load's error."""
        errors = self.adapters.activate({r.adapter for r in self.scheduler.running
                                         if r.adapter is not None})
        if not errors:
            return work
        for req in list(self.scheduler.running):
            if req.adapter in errors and req.status != Status.FINISHED:
                req.group.error = errors[req.adapter]
                outputs += self._finish_group(req.group, "abort")
        return [(r, n) for r, n in work if r.status != Status.FINISHED]

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> list:
        """(token, logprobs) per row. Should the batched sampler fail, each row is sampled on
        its own, so one request's failure (its exception in place of its token) does not end
        the step for the others."""
        try:
            out = self.sampler(logits, rows)
            return list(zip(out.token_ids, out.logprobs))
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling them one by one", len(rows))
        results: list = []
        for i, req in enumerate(rows):
            try:
                out = self.sampler(logits[i:i + 1], [req])
                results.append((out.token_ids[0], out.logprobs[0]))
            except Exception as exc:
                results.append(exc)
        return results

    def _fail_group(self, group: Group, stage: str, exc: Exception) -> list[RequestOutput]:
        """End one request with an error; the engine and every other request go on."""
        if group.request_id not in self.groups:
            return []
        log.error("request %s failed while %s: %s: %s", group.request_id, stage,
                  type(exc).__name__, exc, exc_info=exc)
        group.error = f"internal error while {stage}: {type(exc).__name__}: {exc}"
        return self._finish_group(group, "abort")

    def _publish_scores(self, req: Request) -> None:
        """Offer the prompt entries of req's newly full blocks to the prefix cache, so a later
        hit on those blocks still knows them (engine/prompt_logprobs.py)."""
        scores, bs = req.scores, self.kv.block_size
        full = min(len(req.block_hashes), scores.filled // bs)
        for i in range(scores.published, full):
            h = req.block_hashes[i]
            old = self.kv.block_scores.get(h)
            if h in self.kv.cached and (old is None or old.k < scores.k):
                self.kv.block_scores[h] = scores.block(i, bs)
        scores.published = max(scores.published, full)

    def _fork_groups(self, samplers: list[Request]) -> tuple[list[Request], list[int]]:
        """Leaders whose prompt just finished spawn their n-1 siblings, which sample their first
        token from the leader's logits row; returns the sampling sequences and their rows."""
        seqs, rows = [], []
        for row, req in enumerate(samplers):
            seqs.append(req)
            rows.append(row)
            group = req.group
            if req.index != 0 or not group.needs_fork:
                continue
            for index in range(1, group.n):
                sib = self._new_sequence(group, index, list(req.all_token_ids), req.params,
                                         req.max_tokens, req.metrics.arrival_time, req.priority)
                sib.num_cached_tokens = req.num_cached_tokens
                copy = self.kv.fork(req, sib)
                # With no block free for the copy, the sibling waits and recomputes its prompt
                # later (mostly from the prefix cache); its first token is sampled now either way.
                forked = copy is not False
                if forked:
                    if copy is not None:
                        self.runner.copy_block(*copy)
                    sib.num_computed_tokens = req.num_computed_tokens
                self.scheduler.add_forked(sib, running=forked)
                seqs.append(sib)
                rows.append(row)
        return seqs, rows

    def _append_token(self, req: Request, token: int, lp, now: float) -> list[RequestOutput]:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.all_token_ids.append(token)
        if lp is not None:
            req.logprobs.append(TokenLogprob(token, lp[0], lp[1]))
        reason = self._check_stop(req, token)
        if reason is not None:
            return self._finish(req, reason)
        if req.group.stream:
            return [req.group.output([self._completion(req, partial=True)], finished=False)]
        return []

    def _check_stop(self, req: Request, token: int) -> str | None:
        p = req.params
        detok = req.detokenizer
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

    def _completion(self, req: Request, partial: bool = False) -> CompletionOutput:
        detok = req.detokenizer
        if partial:
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

    def _finish(self, req: Request, reason: str) -> list[RequestOutput]:
        """Finish one sequence; returns what to report (the group's output once all n are done)."""
        self.scheduler.finish(req)
        self.sampler.forget(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = time.time()
        group = req.group
        group.done[req.index] = self._completion(req)
        self.stats.generation_tokens += req.num_output_tokens
        if reason == "abort" and group.needs_fork:
            return self._finish_group(group, "abort")
        if group.finished:
            return [self._close(group)]
        if group.stream:
            return [group.output([group.done[req.index]], finished=False)]
        return []

    def _finish_group(self, group: Group, reason: str) -> list[RequestOutput]:
        for req in group.live():
            self.scheduler.finish(req)
            self.sampler.forget(req.request_id)
            req.status = Status.FINISHED
            req.finish_reason = reason
            try:
                group.done[req.index] = self._completion(req)
            except Exception:  # the detokenizer that failed this request: report no text
                group.done[req.index] = CompletionOutput(
                    index=req.index, text="", token_ids=req.output_token_ids,
                    finish_reason=reason, logprobs=req.logprobs)
            self.stats.generation_tokens += req.num_output_tokens
        for index in range(len(group.members), group.n):  # never forked
            group.done[index] = CompletionOutput(index=index, text="", token_ids=[], finish_reason=reason)
        return [self._close(group)]

    def _close(self, group: Group) -> RequestOutput:
        self.groups.pop(group.request_id, None)
        leader = group.leader
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += leader.num_prompt_tokens
        self.stats.cached_tokens += max(leader.num_cached_tokens, 0)
        return group.final_output()

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
