"""After the forward pass, one owner turns the runner's ModelOutput into request updates
(vLLM's update_from_output): prompt entries, computed tokens and the prefix cache, then
forks (n > 1), sampled tokens and stop checks.

Each per-step output is one stage, applied in the order of OutputProcessor.stages; a new one is
a method here, registered there (and its field on ModelOutput, which the runner fills).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from batchrun.engine.client import EngineStats
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.model_output import ModelOutput
from batchrun.engine.outputs import RequestOutput, TokenLogprob
from batchrun.engine.request import Request, Status
from batchrun.engine.sampler import RowLogprobs, Sampler
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.score_cache import ScoreCache
from batchrun.engine.sequences import Sequences
from batchrun.engine.stop import stop_reason

log = logging.getLogger(__name__)

Work = list[tuple[Request, int]]


class OutputProcessor:
    def __init__(self, sequences: Sequences, scheduler: Scheduler, kv: KVCacheManager,
                 scores: ScoreCache, sampler: Sampler, copy_block: Callable[[int, int], None],
                 stats: EngineStats, eos_token_ids: set[int], max_model_len: int,
                 copy_state: Callable[[int, int], None] | None = None):
        self.sequences = sequences
        self.scheduler = scheduler
        self.kv = kv
        self.scores = scores
        self.sampler = sampler
        self.copy_block = copy_block  # ModelRunner.copy_block: a forked sequence's tail block
        self.copy_state = copy_state  # ModelRunner.copy_state: a forked sequence's state slot
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stages: tuple[Callable[[Work, ModelOutput], list[RequestOutput]], ...] = (
            self.put_prompt_scores, self.advance, self.sample)

    def update(self, work: Work, out: ModelOutput) -> list[RequestOutput]:
        """Apply one step's output to its work; the outputs to report."""
        outputs: list[RequestOutput] = []
        for stage in self.stages:
            outputs += stage(work, out)
        return outputs

    def put_prompt_scores(self, work: Work, out: ModelOutput) -> list[RequestOutput]:
        for req, first, *entries in out.scored:
            req.scores.put(first, *entries)
        return []

    def advance(self, work: Work, out: ModelOutput) -> list[RequestOutput]:
        """The scheduled tokens are computed: count them, cache the blocks they filled (and
        their prompt entries); a request with max_tokens=0 ends once its prompt is."""
        prompt_only = []
        for req, n in work:
            self.stats.prefill_tokens += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
            req.num_computed_tokens += n
            self.stats.computed_tokens += n + req.rescore
            req.rescore = False
            self.kv.cache_full_blocks(req)
            if req.scores is not None:
                self.scores.publish(req)
            if req.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
                prompt_only.append(req)
        outputs = []
        for req in prompt_only:  # max_tokens=0: the prompt is all there is to compute
            outputs += self.sequences.finish_group(req.group, "length")
        return outputs

    def sample(self, work: Work, out: ModelOutput) -> list[RequestOutput]:
        if not out.samplers:
            return []
        outputs: list[RequestOutput] = []
        logits = out.logits
        samplers, rows = self.fork_groups(out.samplers)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        now = time.time()
        for req, sampled in zip(samplers, self.sample_rows(logits, samplers)):
            if req.status == Status.FINISHED:
                continue  # a sibling's failure already ended its group
            if isinstance(sampled, Exception):
                outputs += self.sequences.fail_group(req.group, "sampling", sampled)
                continue
            try:
                self.sampler.accept(req, sampled[0])
                outputs += self.append_token(req, *sampled, now)
            except Exception as exc:  # a grammar or detokenizer failure ends this request only
                outputs += self.sequences.fail_group(req.group, "decoding", exc)
        return outputs

    def sample_rows(self, logits: torch.Tensor, rows: list[Request]
                    ) -> list[tuple[int, RowLogprobs] | Exception]:
        """(token, logprobs) per row. Should the batched sampler fail, each row is sampled on
        its own, so one request's failure (its exception in place of its token) does not end
        the step for the others."""
        try:
            out = self.sampler(logits, rows)
            return list(zip(out.token_ids, out.logprobs))
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling them one by one", len(rows))
        results: list[tuple[int, RowLogprobs] | Exception] = []
        for i, req in enumerate(rows):
            try:
                out = self.sampler(logits[i:i + 1], [req])
                results.append((out.token_ids[0], out.logprobs[0]))
            except Exception as exc:
                results.append(exc)
        return results

    def fork_groups(self, samplers: list[Request]) -> tuple[list[Request], list[int]]:
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
                sib = self.sequences.new_sequence(group, index, list(req.all_token_ids),
                                                  req.params, req.max_tokens,
                                                  req.metrics.arrival_time, req.priority)
                sib.num_cached_tokens = req.num_cached_tokens
                copies = self.kv.fork(req, sib)
                # With no block free for the copy, the sibling waits and recomputes its prompt
                # later (mostly from the prefix cache); its first token is sampled now either way.
                if copies is not False:
                    for src, dst in copies:
                        self.copy_block(src, dst)
                    if sib.state_slot is not None and self.copy_state is not None:
                        assert req.state_slot is not None
                        self.copy_state(req.state_slot, sib.state_slot)
                    sib.num_computed_tokens = req.num_computed_tokens
                self.scheduler.add_forked(sib, running=copies is not False)
                seqs.append(sib)
                rows.append(row)
        return seqs, rows

    def append_token(self, req: Request, token: int, lp: RowLogprobs,
                     now: float) -> list[RequestOutput]:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.all_token_ids.append(token)
        if lp is not None:  # asked for: the request keeps a list
            assert req.logprobs is not None
            req.logprobs.append(TokenLogprob(token, lp[0], lp[1]))
        reason = stop_reason(req, token, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            return self.sequences.finish(req, reason)
        if req.group.stream:
            return [req.group.output([self.sequences.completion(req, partial=True)],
                                     finished=False)]
        return []
