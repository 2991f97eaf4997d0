"""Continuous-batching scheduler: one token budget per step, decode and chunked prefill together.

Running requests are served first (a decode is one token; a request still prefilling takes what
the budget leaves), then waiting requests are admitted while the budget, max_num_seqs and the KV
pool allow. Under KV pressure the newest running request is preempted: its blocks go back to the
pool (keeping their prefix-cache hashes) and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchrun.config import SchedulerConfig
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request, Status


@dataclass
class ScheduledStep:
    # (request, number of its tokens to compute this step), running decodes first.
    work: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never fit in the KV pool.
    rejected: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(req)
                step.work.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.kv.blocks_needed(req.num_tokens) > self.kv.num_blocks:
                self.waiting.popleft()
                step.rejected.append(req)
                continue
            if req.num_computed_tokens == 0:
                cached = self.kv.match_prefix(req)
                req.num_computed_tokens = cached
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = cached
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req, req.num_computed_tokens + n):
                if not self.running and not scheduled:
                    # Nothing else holds blocks, yet it does not fit: only cached-but-free blocks
                    # could be in the way, and allocate() evicts those, so this cannot happen
                    # unless the pool is smaller than the request's first chunk.
                    self.kv.free_request(req)
                    req.num_computed_tokens = 0
                    self.waiting.popleft()
                    step.rejected.append(req)
                    continue
                self.kv.free_request(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append(req)
            step.work.append((req, n))
            budget -= n
        return step

    def _preempt(self, req: Request) -> None:
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        self.kv.free_request(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
