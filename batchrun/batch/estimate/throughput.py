"""A throughput model of this engine on this machine: how long a batch run will take.

The cost model. One engine step is one forward pass over every token scheduled in it (decode
rows and prefill chunks together), then the logits and sampling of the rows that produce a
token. Its wall time is modelled as linear in what the step does:

    step_time = step_s                      per step: the weights streamed once, Python, metadata
              + token_s   * tokens          per token run through the model (all layers)
              + context_s * context         per context token a decode row's attention reads
              + pair_s    * pairs           per (query, key) pair of prefill attention
              + sample_s  * sampled         per row sampled: lm_head, sampler, bookkeeping

and each request costs request_s outside the steps (adding it, finishing it, detokenising).

Since the model is linear, the whole run's time is those coefficients times the run's totals:
tokens = uncached prompt tokens + decode rows, context and pairs follow from each request's
prompt and completion lengths, sampled = completion tokens. They are known exactly from the
workload (`WorkloadShape.add` per request). Only the number of steps depends on scheduling;
`estimate_seconds` gets it by simulating the scheduler (continuous batching, chunked prefill
under max_num_batched_tokens, at most min(max_num_seqs, the runner's in-flight window, what
the KV pool holds) running) on identical requests of the workload's mean lengths: a few waves
(eight) are simulated step by step, and the steady state's steps per request extrapolate the
rest (within ~2% of simulating everything).

Calibration: `calibrate()` (batch/calibrate.py) times the real engine on a random-weight model of the same
architecture cut to 2 layers (1 for a 1-layer model), with every decoder layer timed, so the
per-layer part of each coefficient is measured directly and scaled to the real depth; the rest
(embedding, lm_head at the real vocabulary, sampling, Python) is measured as is. Decode steps
of a scenario are reduced to their median (a shared machine stalls single steps), and the
prefill attention pair cost is tied to the per-token cost by their FLOPs
(`calibrate.pair_token_ratio`) rather than fitted: the two rise together in every prefill
step. Or
`calibration_from_run()` rescales a cost model to a finished run's wall time on this machine
(batch/run_store.py keeps the recent runs per model and machine), and keeps how many more steps
the run took than the simulation of its workload gives (`steps_factor`: a batch's steps follow
its longest requests, the simulation its mean ones), so that the estimate of the file a run
calibrated on is that run's time.

What it does not see: requests that stop early (the plan counts the requested max_tokens, so
its estimate is an upper bound on the decode part), preemption under KV pressure, the batch
runner's own per-line work (parsing, rendering, writing: pass `host_seconds`), other load on
the machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from batchrun.batch.job.plan import default_max_in_flight
from batchrun.options.engine import EngineConfig


@dataclass
class WorkloadShape:
    """Totals of a workload, accumulated one request at a time with `add` (or `from_totals`)."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Sum over decode rows of the context each one attends to (prompt + tokens so far).
    decode_context_tokens: int = 0
    # Sum over computed (uncached) prompt tokens of their context length (query-key pairs).
    prefill_pairs: int = 0
    max_prompt_tokens: int = 0
    max_completion_tokens: int = 0
    # Seconds of work outside the engine the run will do (the runner's rendering, say).
    host_seconds: float = 0.0

    def add(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        p, g, c = prompt_tokens, completion_tokens, min(cached_tokens, max(prompt_tokens - 1, 0))
        self.requests += 1
        self.prompt_tokens += p
        self.cached_tokens += c
        self.completion_tokens += g
        if g > 1:  # rows at contexts p + 1 .. p + g - 1 (the first token comes from the prefill)
            self.decode_context_tokens += (g - 1) * p + (g - 1) * g // 2
        self.prefill_pairs += (p * (p + 1) - c * (c + 1)) // 2
        self.max_prompt_tokens = max(self.max_prompt_tokens, p)
        self.max_completion_tokens = max(self.max_completion_tokens, g)

    @classmethod
    def from_totals(cls, requests: int, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> "WorkloadShape":
        """A shape of `requests` identical requests of the mean lengths (when only totals are
        known, as in a run's metrics)."""
        shape = cls()
        if requests <= 0:
            return shape
        p, g, c = (prompt_tokens / requests, completion_tokens / requests,
                   cached_tokens / requests)
        shape.requests, shape.prompt_tokens = requests, prompt_tokens
        shape.cached_tokens, shape.completion_tokens = cached_tokens, completion_tokens
        if g > 1:
            shape.decode_context_tokens = round(requests * ((g - 1) * p + (g - 1) * g / 2))
        shape.prefill_pairs = round(requests * (p * (p + 1) - c * (c + 1)) / 2)
        shape.max_prompt_tokens, shape.max_completion_tokens = math.ceil(p), math.ceil(g)
        return shape

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens / self.requests if self.requests else 0.0

    @property
    def mean_completion_tokens(self) -> float:
        return self.completion_tokens / self.requests if self.requests else 0.0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def decode_rows(self) -> int:
        """Decode steps' rows: every completion token but each request's first."""
        return max(self.completion_tokens - self.requests, 0)


@dataclass
class Calibration:
    """Coefficients of the step-time model (seconds; see the module docstring)."""
    source: str  # e.g. "micro-benchmark (3.1 s)" or "last run 2026-12-01 16:40 over chat.jsonl"
    step_s: float
    token_s: float
    context_s: float
    pair_s: float
    sample_s: float
    request_s: float = 0.0
    details: dict = field(default_factory=dict)  # what the fit saw (per-layer parts, residual)
    # Engine steps a run took per step the scheduler simulation predicts for its workload
    # (calibration_from_run): the simulation runs identical requests of the mean lengths, but
    # a real run's steps follow its longest requests (the drain), and an estimate of the same
    # workload has to take as many steps as the run did.
    steps_factor: float = 1.0

    def scaled(self, factor: float, source: str) -> "Calibration":
        return dataclasses.replace(
            self, source=source, step_s=self.step_s * factor, token_s=self.token_s * factor,
            context_s=self.context_s * factor, pair_s=self.pair_s * factor,
            sample_s=self.sample_s * factor, request_s=self.request_s * factor,
            details={**self.details, "scaled_by": factor, "scaled_from": self.source})


# ---- the estimate ----------------------------------------------------------------------------


def estimate_seconds(shape: WorkloadShape, calibration: Calibration, engine_config: EngineConfig,
                     max_in_flight: int | None = None,
                     num_blocks: int | None = None, steps: int | None = None) -> float:
    """Estimated wall time of running `shape` (see the module docstring). `num_blocks`: the KV
    pool (None = engine_config.cache.num_blocks, else unbounded); `steps`: the engine steps if
    known (a finished run's), else simulated."""
    if shape.requests <= 0:
        return shape.host_seconds
    if steps is None:
        steps = max(1, round(calibration.steps_factor *
                             estimate_steps(shape, engine_config, max_in_flight, num_blocks)))
    c = calibration
    return (c.step_s * steps
            + c.token_s * (shape.uncached_tokens + shape.decode_rows)
            + c.context_s * shape.decode_context_tokens
            + c.pair_s * shape.prefill_pairs
            + c.sample_s * shape.completion_tokens
            + c.request_s * shape.requests
            + shape.host_seconds)


def concurrency(shape: WorkloadShape, engine_config: EngineConfig,
                max_in_flight: int | None = None, num_blocks: int | None = None) -> int:
    """Requests running at once: max_num_seqs, the in-flight window (None: a run's default),
    the KV pool's room for requests of the mean length, and the number of requests, whichever
    is smallest."""
    sched = engine_config.scheduler
    window = max_in_flight or default_max_in_flight(engine_config)
    limit = min(sched.max_num_seqs, window, shape.requests)
    num_blocks = num_blocks if num_blocks is not None else engine_config.cache.num_blocks
    if num_blocks:
        bs = engine_config.cache.block_size
        per_request = max(1, math.ceil((shape.mean_prompt_tokens + shape.mean_completion_tokens) / bs))
        limit = min(limit, max(1, num_blocks // per_request))
    return max(1, limit)


def estimate_steps(shape: WorkloadShape, engine_config: EngineConfig,
                   max_in_flight: int | None = None, num_blocks: int | None = None) -> int:
    """Engine steps for `shape`: the scheduler simulated on identical requests of the mean
    lengths, eight waves of `concurrency` requests at most, the steady state (waves 4 to 7)
    extrapolated."""
    n = shape.requests
    if n <= 0:
        return 0
    width = concurrency(shape, engine_config, max_in_flight, num_blocks)
    simulated = min(n, 8 * width)
    prefill = max(1, round(shape.uncached_tokens / n))
    decode = max(0, round(shape.mean_completion_tokens) - 1)
    finish = _simulate(simulated, width, prefill, decode, engine_config.scheduler.max_num_batched_tokens)
    total: float = finish[-1]
    if n > simulated:  # steady state: steps per request between the second and fourth wave
        # (the last wave is left out of the rate: it holds the drain, paid once)
        per_request = (finish[7 * width - 1] - finish[3 * width - 1]) / (4 * width)
        total += (n - simulated) * per_request
    return max(1, round(total))


def _simulate(n: int, width: int, prefill: int, decode: int, budget: int) -> list[int]:
    """Step at which each of n identical requests finishes, in order: prefill tokens chunked
    under the step budget, then `decode` one-token steps, at most `width` running, running
    requests served before waiting ones are admitted (batchrun.engine.scheduler)."""
    running: list[list[int]] = []  # [prefill left, decode left]
    waiting = n
    finish: list[int] = []
    for step in itertools.count(1):
        left = budget
        for r in running:
            if left <= 0:
                break
            if r[0] > 0:
                take = min(r[0], left)
                r[0] -= take
                left -= take
            else:
                r[1] -= 1
                left -= 1
        while waiting and left > 0 and len(running) < width:
            take = min(prefill, left)
            running.append([prefill - take, decode])
            left -= take
            waiting -= 1
        done = [r for r in running if r[0] == 0 and r[1] <= 0]
        if done:
            running = [r for r in running if not (r[0] == 0 and r[1] <= 0)]
            finish.extend([step] * len(done))
        if not running and not waiting:
            return finish
    raise AssertionError("unreachable")


# ---- calibration from the last run -----------------------------------------------------------


def prior(model_config, flops: float = 50e9, bandwidth: float = 10e9,
          step_overhead_s: float = 2e-3) -> Calibration:
    """An uncalibrated cost model from the architecture alone (float32, an assumed machine of
    `flops` and `bandwidth`): only the ratios between coefficients matter once a run rescales
    it (calibration_from_run)."""
    from batchrun.footprint import compute

    cfg = model_config
    cost = compute(cfg)  # FLOPs of the active parameters: top-k of an MoE's experts
    return Calibration(
        source="prior (uncalibrated)",
        step_s=step_overhead_s + 2 * (cost.layer_flops + cost.logits_flops) / bandwidth,
        token_s=cost.layer_flops / flops,
        context_s=4 * cfg.kv_bytes_per_token / bandwidth,
        pair_s=cost.attention_flops / flops,
        sample_s=cost.logits_flops / flops + 50e-6,
        request_s=200e-6)


def calibration_from_run(summary: Mapping[str, Any], engine_config: EngineConfig, model_config,
                         base: Calibration | None = None,
                         max_in_flight: int | None = None,
                         num_blocks: int | None = None) -> Calibration | None:
    """A Calibration fitted to a finished run's metrics summary (batch/metrics.py; what
    a run_store.load_runs record works too): `base` (a micro-benchmark's, else the architecture's
    prior) scaled so that it predicts the run's wall time from the run's token counts and
    engine steps, and the run's steps over the steps the simulation gives its workload
    (under max_in_flight and num_blocks, as the estimate will simulate) kept as steps_factor:
    estimating the same file again reproduces the run's time. None when the summary cannot
    calibrate (no completed request, no time)."""
    record: Mapping[str, Any] = summary if "summary" not in summary else summary["summary"]
    try:
        wall = float(record["wall_time_s"])
        requests = record.get("requests", {})  # a count, or counts by outcome
        if isinstance(requests, dict):
            requests = requests["ok"] if "ok" in requests else requests.get("total", 0)
        n = int(requests)
        shape = WorkloadShape.from_totals(n, int(record["prompt_tokens"]),
                                          int(record["completion_tokens"]),
                                          int(record.get("cached_tokens", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    if n <= 0 or wall <= 0 or not math.isfinite(wall):
        return None
    steps = (record.get("engine") or {}).get("steps") or None
    base = dataclasses.replace(base or prior(model_config), steps_factor=1.0)
    simulated = estimate_steps(shape, engine_config, max_in_flight, num_blocks)
    if steps is None:
        steps = simulated
    predicted = estimate_seconds(shape, base, engine_config, steps=steps)
    if predicted <= 0:
        return None
    when = summary.get("saved_at", "")
    where = record.get("input")
    if isinstance(where, list):
        where = f"{len(where)} inputs"
    source = "last run" + (f" {when[:16].replace('T', ' ')}" if when else "")
    source += f" over {os.path.basename(str(where))}" if where else ""
    source += f" ({n} requests, {wall:.1f} s)"
    return dataclasses.replace(base.scaled(wall / predicted, source),
                               steps_factor=steps / simulated if simulated > 0 else 1.0)
