"""Continuous-batching scheduler: one token budget per step, decode and chunked prefill together.

Running requests are served first (a decode is one token; a request still prefilling takes what
the budget leaves), then waiting requests are admitted while the budget, max_num_seqs and the KV
pool allow. Under KV pressure the newest running request is preempted: its blocks go back to the
pool (keeping their prefix-cache hashes) and it is recomputed later.

Requests carry a priority (lower = sooner; interactive traffic ahead of Batches-API work): running
requests are served and waiting ones admitted in priority order, and preemption takes the newest
request of the lowest priority first.

With LoRA adapters, the running requests use at most max_loras adapters (all resident at once):
a waiting request of another adapter is passed over, and stays at the front of the queue, until
one of those adapters has no running request left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchrun.options.engine import SchedulerConfig
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request, Status
from batchrun.engine.score_cache import ScoreCache
from batchrun.engine.waiting import WaitingQueue


@dataclass
class ScheduledStep:
    # (request, number of its tokens to compute this step), running decodes first.
    work: list[tuple[Request, int]] = field(default_factory=list)
    # Requests that can never fit in the KV pool.
    rejected: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, scores: ScoreCache,
                 max_loras: int | None = None):
        self.config = config
        self.kv = kv
        self.scores = scores  # prompt entries of cached blocks, for scoring requests' matches
        self.max_loras = max_loras
        self.waiting = WaitingQueue(config.group_by_prefix)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_forked(self, req: Request, running: bool) -> None:
        """A sibling forked from a running request: runs next step, or waits to recompute."""
        if running:
            req.status = Status.RUNNING
            self.running.append(req)
        else:
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        self.running.sort(key=lambda r: r.priority)  # stable: keeps arrival order within a level
        budget = self._continue_running(step, self.config.max_num_batched_tokens)
        self._admit_waiting(step, budget)
        for req, n in step.work:  # a stateful model's state at the boundaries each chunk passes
            self.kv.plan_checkpoints(req, n)
        return step

    def _continue_running(self, step: ScheduledStep, budget: int) -> int:
        """The running requests' next chunks, preempting from the back when blocks run out;
        returns the token budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n < 1:  # its next image does not fit in what is left of the budget
                i += 1
                continue
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop(self._victim_index(i))
                self._preempt(victim)
                if victim is req:
                    break
            else:
                step.work.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted
        return budget

    def _admit_waiting(self, step: ScheduledStep, budget: int) -> None:
        """Waiting requests into the step while budget, sequences and blocks allow (a request
        whose adapter would exceed --max-loras is passed over, keeping its place)."""
        in_flight: set[bytes] | None = None
        adapters = {r.adapter for r in self.running if r.adapter is not None}
        passed_over: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req.adapter is not None and req.adapter not in adapters and \
                    self.max_loras is not None and len(adapters) >= self.max_loras:
                if len(passed_over) >= self.config.max_num_seqs:
                    break
                passed_over.append(self.waiting.popleft())
                continue
            if self.kv.blocks_needed(req.num_tokens, self.config.max_num_batched_tokens) \
                    > self.kv.num_blocks:
                self.waiting.popleft()
                step.rejected.append(req)
                continue
            if req.num_computed_tokens == 0:
                if in_flight is None:
                    in_flight = self._blocks_in_flight()
                if not self._start_from_prefix(req, in_flight):
                    break
            extra = self._rescore_rows(req)
            n = self._chunk(req, budget - extra)
            fits = n >= 1 and self.kv.allocate(req, req.num_computed_tokens + n)
            if not fits:
                self.kv.free_request(req)
                req.num_computed_tokens = 0
                if n >= 1 and not self.running and not step.work:
                    # Nothing else holds blocks, yet it does not fit: only cached-but-free blocks
                    # could be in the way, and allocate() evicts those, so this cannot happen
                    # unless the pool is smaller than the request's first chunk.
                    self.waiting.popleft()
                    step.rejected.append(req)
                    continue
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            if in_flight is not None and self.kv.enable_prefix_caching:
                in_flight.update(self.kv.prompt_hashes(req)[req.num_computed_tokens // self.kv.block_size:])
            step.work.append((req, n))
            req.rescore = bool(extra)
            budget -= n + extra
            if req.adapter is not None:
                adapters.add(req.adapter)
        for req in reversed(passed_over):
            self.waiting.appendleft(req)

    def _start_from_prefix(self, req: Request, in_flight: set[bytes]) -> bool:
        """A new request's computed tokens set to its prefix-cache hit; False (nothing held)
        when it should wait for blocks another request is computing this step."""
        # Mean / cls pooling needs every position's hidden state, which a cached block does not
        # hold: such a request computes its whole prompt (engine/pooling.py).
        all_positions = req.pooled is not None and req.pooled.params.needs_all_positions
        cached = 0 if all_positions else self.kv.match_prefix(req, self.scores.prefix_filter(req))
        if not all_positions and self._waits_for_prefix(req, cached, in_flight):
            self.kv.free_request(req)
            return False
        req.num_computed_tokens = cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = cached
        return True

    @staticmethod
    def _chunk(req: Request, budget: int) -> int:
        """How many of req's tokens to compute with `budget` left: no more than the budget, and
        no chunk ending inside an image whose tokens attend both ways (engine/multimodal.py)."""
        start = req.num_computed_tokens
        end = start + min(req.num_tokens - start, budget)
        if req.multimodal is not None:
            end = req.multimodal.chunk_end(start, end)
        return end - start

    @staticmethod
    def _rescore_rows(req: Request) -> int:
        """1 when the entry of the first uncomputed prompt token needs the (cached, so not
        computed) position before it."""
        s = req.scores
        return int(s is not None and not s.done and 0 < req.num_computed_tokens == s.filled)

    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests are still prefilling."""
        if not self.kv.enable_prefix_caching:
            return set()
        pending: set[bytes] = set()
        bs = self.kv.block_size
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                pending.update(self.kv.prompt_hashes(r)[r.num_computed_tokens // bs:])
        return pending

    def _waits_for_prefix(self, req: Request, cached: int, in_flight: set[bytes]) -> bool:
        """True when req's next uncached block is being computed by a running request: admitting
        it now would compute the shared prefix twice; a step or two later it is a cache hit."""
        if not in_flight:
            return False
        hashes = self.kv.prompt_hashes(req)
        k = self.kv.next_hit_block(cached)
        return k < len(hashes) and hashes[k] in in_flight

    def _victim_index(self, first: int) -> int:
        """Among running requests not yet scheduled this step (index >= first): the newest of
        the lowest priority."""
        return max(range(first, len(self.running)), key=lambda j: (self.running[j].priority, j))

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
