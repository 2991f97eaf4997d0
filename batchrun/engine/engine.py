"""Engine: requests in, one scheduled forward pass per step, outputs out."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from batchrun.engine.client import EngineStats
from batchrun.engine.errors import PromptTooLongError
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.kv_groups import kv_groups
from batchrun.engine.kv_sizing import (checkpoint_interval, state_checkpoint_count,
                                       state_slot_count)
from batchrun.engine.lora import AdapterSlots
from batchrun.engine.model import KeepsState, TakesImages
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import RequestOutput
from batchrun.engine.request import Group, Request, Status
from batchrun.engine.request_checks import ImagesCheck, LoraCheck, PoolingCheck, RequestCheck
from batchrun.engine.runner import ModelRunner
from batchrun.engine.sampler import Sampler
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.scheduler import Scheduler, ScheduledStep
from batchrun.engine.score_cache import ScoreCache
from batchrun.engine.state_checkpoints import CheckpointPool
from batchrun.engine.state_slots import StateSlots
from batchrun.engine.sequences import Sequences
from batchrun.engine.update import OutputProcessor
from batchrun.options.engine import EngineConfig


class Engine:
    """Synchronous continuous-batching engine (a batchrun.engine.client.EngineClient). Typical loop:

        engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=64))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished: ...
    """

    def __init__(self, model, tokenizer, config: EngineConfig, eos_token_ids: Sequence[int],
                 device: torch.device, dtype: torch.dtype, num_blocks: int, max_model_len: int,
                 kv_dtype: torch.dtype | None = None, adapters: AdapterSlots | None = None,
                 kv_scales: torch.Tensor | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        bs = config.cache.block_size
        model_cfg = model.config
        groups = kv_groups(model_cfg)
        # A model with recurrent state: a slot per running sequence (fewer where they would
        # crowd out the KV blocks: kv_sizing.state_slot_count); a prefix cache only through
        # state checkpoints (engine/state_checkpoints.py), when its layers write them.
        slots, checkpoints = state_counts(config, model, model_cfg, device)
        self.kv = KVCacheManager(
            num_blocks, bs, config.cache.enable_prefix_caching and (not slots or checkpoints > 0),
            groups, StateSlots(slots) if slots else None,
            CheckpointPool(slots, checkpoints, checkpoint_interval(config)) if checkpoints
            else None)
        # LoRA adapters served on this model (engine/lora.py); None = none.
        self.adapters = adapters
        self.scores = ScoreCache(self.kv)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.scores,
                                   adapters.max_loras if adapters is not None else None)
        self.runner = ModelRunner(model, num_blocks, bs, device, dtype, kv_dtype,
                                  config.scheduler.max_num_seqs, max_model_len,
                                  cuda_graphs=config.device.cuda_graphs, adapters=adapters,
                                  attention_kernel="invariant" if config.batch_invariant
                                  else config.device.attention_kernel, groups=groups,
                                  kv_scales=kv_scales, num_state_slots=slots,
                                  num_checkpoints=checkpoints)
        self.sampler = Sampler(device, tokenizer, self.eos_token_ids)
        self.stats = EngineStats(num_kv_blocks=num_blocks)
        self.sequences = Sequences(tokenizer, self.scheduler, self.sampler, self.stats)
        self.updater = OutputProcessor(self.sequences, self.scheduler, self.kv, self.scores,
                                       self.sampler, self.runner.copy_block, self.stats,
                                       self.eos_token_ids, max_model_len,
                                       copy_state=self.runner.copy_state)
        # what a request may ask of this engine, by feature (engine/request_checks.py)
        self.request_checks: list[RequestCheck] = [
            LoraCheck(adapters), PoolingCheck(model.num_labels),
            ImagesCheck(model, config.scheduler.max_num_batched_tokens)]

    @property
    def hidden_size(self) -> int | None:
        """The width of the model's final hidden states (a pooled embedding's dimensions);
        None when the model's config does not say."""
        return self.runner.model.config.hidden_size

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
        if request_id in self.sequences.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if params.n < 1:
            raise ValueError("n must be at least 1")
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
        if multimodal is None and isinstance(self.runner.model, TakesImages):
            multimodal = MultiModalInputs([])  # a text prompt its model may mark (PaliGemma's
            # prefix attends both ways, images or not)
        for feature in self.request_checks:
            feature.check(prompt_token_ids, params, multimodal)
        group = Group(request_id, params.n, stream)
        if multimodal is not None and (multimodal.images or multimodal.both_ways):
            group.multimodal = multimodal
        leader = self.sequences.new_sequence(group, 0, list(prompt_token_ids), params, max_tokens,
                                              arrival_time, priority)
        self.sequences.groups[request_id] = group
        self.scheduler.add(leader)

    @property
    def groups(self) -> dict[str, Group]:
        """The user requests still in the engine, by id."""
        return self.sequences.groups

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still in the engine (waiting, running or preempted)."""
        return bool(self.sequences.groups)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output."""
        group = self.sequences.groups.get(request_id)
        if group is None:
            return None
        return self.sequences.finish_group(group, "abort")[0]

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass; the finished (and, for streamed requests,
        partial) outputs it produced."""
        plan = self.scheduler.schedule()
        outputs = self._reject(plan)
        work = self._activate_adapters(plan.work, outputs) if self.adapters is not None \
            and plan.work else plan.work
        if not work:
            return outputs
        self._mark_scheduled(work)
        out = self.runner.execute(work)
        self._count_step()
        outputs += self.updater.update(work, out)
        self.stats.peak_kv_usage = self.kv.peak_used / self.kv.num_blocks
        return outputs

    def _reject(self, plan: ScheduledStep) -> list[RequestOutput]:
        outputs = []
        for req in plan.rejected:
            need = self.kv.blocks_needed(req.num_tokens,
                                         self.config.scheduler.max_num_batched_tokens)
            req.group.error = (f"the request needs {need} KV "
                               f"blocks but the pool holds {self.kv.num_blocks}; raise --kv-cache-memory")
            outputs += self.sequences.finish_group(req.group, "abort")
        return outputs

    @staticmethod
    def _mark_scheduled(work: list[tuple[Request, int]]) -> None:
        now = time.time()
        for req, _ in work:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now

    def _count_step(self) -> None:
        self.stats.steps += 1
        self.stats.num_preemptions = self.scheduler.num_preemptions

    def _activate_adapters(self, work: list[tuple[Request, int]],
                           outputs: list[RequestOutput]) -> list[tuple[Request, int]]:
        """Make the running requests' adapters resident; the work of requests whose adapter
        could not be loaded is dropped and those requests end with the load's error."""
        assert self.adapters is not None  # step calls this only with adapters
        errors = self.adapters.activate({r.adapter for r in self.scheduler.running
                                         if r.adapter is not None})
        if not errors:
            return work
        for req in list(self.scheduler.running):
            if req.adapter is not None and req.adapter in errors and req.status != Status.FINISHED:
                req.group.error = errors[req.adapter]
                outputs += self.sequences.finish_group(req.group, "abort")
        return [(r, n) for r, n in work if r.status != Status.FINISHED]

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


def state_counts(config: EngineConfig, model, model_cfg, device: torch.device
                 ) -> tuple[int, int]:
    """(state slots, state checkpoints) of `model`: (0, 0) without recurrent state; no
    checkpoints unless every stateful layer writes them (StateSpec.checkpoints)."""
    if not isinstance(model, KeepsState):
        return 0, 0
    checkpoints = state_checkpoint_count(config, model_cfg, device) \
        if model.state_spec.checkpoints else 0
    return state_slot_count(config, model_cfg, device), checkpoints
