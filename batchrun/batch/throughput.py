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

Calibration: `calibrate()` times the real engine on a random-weight model of the same
architecture cut to 2 layers (1 for a 1-layer model), with every decoder layer timed, so the
per-layer part of each coefficient is measured directly and scaled to the real depth; the rest
(embedding, lm_head at the real vocabulary, sampling, Python) is measured as is. Decode steps
of a scenario are reduced to their median (a shared machine stalls single steps), and the
prefill attention pair cost is tied to the per-token cost by their FLOPs (`pair_token_ratio`)
rather than fitted: the two rise together in every prefill step. Or
`calibration_from_run()` rescales a cost model to a finished run's wall time on this machine
(batch/run_store.py keeps the last run per model and machine).

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
import time
from dataclasses import dataclass, field
from typing import Any

from batchrun.options.engine import EngineConfig

DEFAULT_MAX_IN_FLIGHT = 256  # batch.runner.RunConfig.max_in_flight


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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def scaled(self, factor: float, source: str) -> "Calibration":
        return dataclasses.replace(
            self, source=source, step_s=self.step_s * factor, token_s=self.token_s * factor,
            context_s=self.context_s * factor, pair_s=self.pair_s * factor,
            sample_s=self.sample_s * factor, request_s=self.request_s * factor,
            details={**self.details, "scaled_by": factor, "scaled_from": self.source})


# ---- the estimate ----------------------------------------------------------------------------


def estimate_seconds(shape: WorkloadShape, calibration: Calibration, engine_config: EngineConfig,
                     max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                     num_blocks: int | None = None, steps: int | None = None) -> float:
    """Estimated wall time of running `shape` (see the module docstring). `num_blocks`: the KV
    pool (None = engine_config.cache.num_blocks, else unbounded); `steps`: the engine steps if
    known (a finished run's), else simulated."""
    if shape.requests <= 0:
        return shape.host_seconds
    if steps is None:
        steps = estimate_steps(shape, engine_config, max_in_flight, num_blocks)
    c = calibration
    return (c.step_s * steps
            + c.token_s * (shape.uncached_tokens + shape.decode_rows)
            + c.context_s * shape.decode_context_tokens
            + c.pair_s * shape.prefill_pairs
            + c.sample_s * shape.completion_tokens
            + c.request_s * shape.requests
            + shape.host_seconds)


def concurrency(shape: WorkloadShape, engine_config: EngineConfig,
                max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, num_blocks: int | None = None) -> int:
    """Requests running at once: max_num_seqs, the in-flight window, the KV pool's room for
    requests of the mean length, and the number of requests, whichever is smallest."""
    sched = engine_config.scheduler
    limit = min(sched.max_num_seqs, max_in_flight, shape.requests)
    num_blocks = num_blocks if num_blocks is not None else engine_config.cache.num_blocks
    if num_blocks:
        bs = engine_config.cache.block_size
        per_request = max(1, math.ceil((shape.mean_prompt_tokens + shape.mean_completion_tokens) / bs))
        limit = min(limit, max(1, num_blocks // per_request))
    return max(1, limit)


def estimate_steps(shape: WorkloadShape, engine_config: EngineConfig,
                   max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, num_blocks: int | None = None) -> int:
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
    total = finish[-1]
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


# ---- the micro-benchmark ---------------------------------------------------------------------


class _NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _bench_model(model_cfg, layers: int, device, dtype):
    """A random-weight model of model_cfg's architecture with `layers` decoder layers, made
    ready for the engine as llm.build_model makes a loaded one (packed linears, CPU kernels)."""
    import torch

    from batchrun.models import packed_linear
    from batchrun.models.llama import LlamaModel

    cfg = dataclasses.replace(model_cfg, num_layers=layers)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rope = type(model.rope)(cfg).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    # As llm.build_model does after loading the weights.
    if device.type == "cpu" and packed_linear.available(dtype):
        if model.lm_head is None:
            model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            model.lm_head.weight = model.embed_tokens.weight
        packed_linear.pack_linears(model)
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from batchrun.engine import kernels

        model.cpu_kernels = kernels.library(kernels.shape_flags(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    return model.eval()


class _StepRecorder:
    """Wraps an engine's step, runner and decoder layers: per step, its features, the time in
    decoder layers and the step's whole time."""

    def __init__(self, engine):
        self.rows: list[tuple] = []  # (tokens, context, pairs, sampled, layer_s, step_s)
        self._layer_s = 0.0
        runner = engine.runner
        execute = runner.execute

        def timed_execute(work):
            tokens = context = pairs = sampled = 0
            for req, n in work:
                c = req.num_computed_tokens
                tokens += n
                if n == 1 and c == req.num_tokens - 1:
                    context += c + 1
                else:
                    pairs += n * c + n * (n + 1) // 2
                if c + n == req.num_tokens and req.max_tokens > 0:
                    sampled += 1
            self._layer_s = 0.0
            start = time.perf_counter()
            out = execute(work)
            self.rows.append((tokens, context, pairs, sampled, self._layer_s,
                              time.perf_counter() - start))
            return out

        runner.execute = timed_execute
        step = engine.step

        def timed_step():
            # The whole step: scheduling and sampling happen outside runner.execute.
            before = len(self.rows)
            start = time.perf_counter()
            out = step()
            if len(self.rows) > before:
                self.rows[-1] = self.rows[-1][:5] + (time.perf_counter() - start,)
            return out

        engine.step = timed_step
        for layer in runner.model.layers:
            forward = layer.forward

            def timed_forward(*args, _forward=forward, **kwargs):
                start = time.perf_counter()
                try:
                    return _forward(*args, **kwargs)
                finally:
                    self._layer_s += time.perf_counter() - start

            layer.forward = timed_forward


def _robust_rows(groups: list[list[tuple]]) -> list[tuple]:
    """One row per prefill step, and per scenario one row for its decode steps (features
    averaged, times their median): a shared machine's stalls hit single steps."""
    import statistics

    rows = []
    for steps in groups:
        decodes = [r for r in steps if r[2] == 0]
        rows += [r for r in steps if r[2] != 0]
        if decodes:
            rows.append(tuple(statistics.fmean(r[k] for r in decodes) for k in range(4))
                        + tuple(statistics.median(r[k] for r in decodes) for k in (4, 5)))
    return rows


def _nonneg_fit(rows: list[list[float]], target: list[float]) -> list[float]:
    """Least squares with coefficients >= 0, relative residuals (each row weighted by 1/target):
    the best of the non-negative unconstrained fits over subsets of the columns."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    y = np.asarray(target, dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    a, y = a * w[:, None], y * w
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y ** 2))
    cols = range(a.shape[1])
    for k in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(cols, k):
            sub = a[:, subset]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(a.shape[1])
                best[list(subset)] = coef
    return best.tolist()


def pair_token_ratio(model_config, inefficiency: float = 2.0) -> float:
    """Cost of one prefill attention (query, key) pair relative to one token's pass through a
    decoder layer's matmuls, from their FLOPs (QK^T and PV: 4 x heads x head_dim)."""
    cfg = model_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_params = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    return inefficiency * 4 * q / (2 * layer_params)


def calibrate(model_config, engine_config: EngineConfig | None = None,
              seconds: float = 3.0) -> Calibration:
    """Time this engine on this machine for `model_config`'s architecture (random weights,
    2 decoder layers, real vocabulary), within about `seconds`; see the module docstring."""
    import torch

    from batchrun.engine.engine import Engine
    from batchrun.engine.sampling_params import SamplingParams
    from batchrun.llm import pick_device, pick_dtype

    start = time.perf_counter()
    config = engine_config or EngineConfig.default()
    device = pick_device(config.device.device)
    dtype = pick_dtype(config.device.dtype, device)
    threads_before = torch.get_num_threads()
    if device.type == "cpu":  # as llm.load_from_path sets them
        threads = config.device.threads or int(os.environ.get("BATCHRUN_THREADS", 0)) or os.cpu_count()
        torch.set_num_threads(threads or 1)
    try:
        layers = min(2, model_config.num_layers)
        model = _bench_model(model_config, layers, device, dtype)
        sched = config.scheduler
        max_seqs = sched.max_num_seqs
        budget = sched.max_num_batched_tokens
        bs = config.cache.block_size
        max_len = min(config.max_model_len or model_config.max_position_embeddings,
                      model_config.max_position_embeddings)
        long_ctx = max(8, min(512, max_len - 64))
        bench_config = config.model_copy(update={
            "cache": config.cache.model_copy(update={
                "num_blocks": max(64, (min(64, max_seqs) + 2) * -(-(long_ctx + 64) // bs)),
                "kv_cache_memory": None, "enable_prefix_caching": True}),
            "max_model_len": max_len})
        engine = Engine(model, _NoTokenizer(), bench_config, [], device, dtype,
                        bench_config.cache.num_blocks, max_len)
        recorder = _StepRecorder(engine)
        gen = torch.Generator().manual_seed(1)
        vocab = model_config.vocab_size

        def tokens(n):
            return torch.randint(0, vocab, (n,), generator=gen).tolist()

        def run(batch, prompt_len, max_tokens, shared=0):
            prefix = tokens(shared)
            prompts = [prefix + tokens(prompt_len - shared) for _ in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            return time.perf_counter() - t0

        big = min(64, max_seqs)
        mid = min(16, max_seqs)
        short = min(128, long_ctx)
        scenarios = [  # (batch, prompt, max_tokens, shared prefix)
            (1, 32, 4, 0),  # warm-up, discarded
            (1, short, 10, 0),
            (mid, max(8, min(24, budget // mid)), 8, 0),
            (big, max(8, min(8, budget // big)), 5, 0),
            (mid, long_ctx, 5, long_ctx - 16),
            (big, short, 4, short - 8),
        ]
        outside, groups = [], []
        for i, (batch, prompt_len, max_tokens, shared) in enumerate(scenarios):
            if i > 3 and time.perf_counter() - start > seconds:
                break
            first = len(recorder.rows)
            wall = run(batch, prompt_len, max_tokens, shared)
            steps_s = sum(r[5] for r in recorder.rows[first:])
            if i == 0:
                del recorder.rows[:]
            else:
                outside.append((wall - steps_s) / batch)
                groups.append(recorder.rows[first:])
        rows = _robust_rows(groups)
        # A prefill attention pair costs what its FLOPs are worth in matmul time (twice, for
        # the kernel's lower efficiency): fitted freely it soaks up the per-token cost, the two
        # rising together in every prefill step.
        ratio = pair_token_ratio(model_config)
        fit = _nonneg_fit([[1.0, r[0] + ratio * r[2], r[1]] for r in rows],
                          [r[4] / layers for r in rows])
        per_layer = [fit[0], fit[1], fit[2], fit[1] * ratio]
        rest = _nonneg_fit([[1.0, r[0], r[3]] for r in rows], [r[5] - r[4] for r in rows])
        depth = model_config.num_layers
        elapsed = time.perf_counter() - start
        return Calibration(
            source=f"micro-benchmark ({elapsed:.1f} s, {len(recorder.rows)} steps, {layers}-layer "
                   f"random-weight model scaled to {depth} layers)",
            step_s=rest[0] + depth * per_layer[0],
            token_s=rest[1] + depth * per_layer[1],
            context_s=depth * per_layer[2],
            pair_s=depth * per_layer[3],
            sample_s=rest[2],
            request_s=max(0.0, sorted(outside)[len(outside) // 2]) if outside else 0.0,
            details={"layers_timed": layers, "depth": depth, "per_layer": per_layer,
                     "outside_layers": rest, "steps": len(recorder.rows), "seconds": elapsed,
                     "threads": torch.get_num_threads(), "dtype": str(dtype)})
    finally:
        torch.set_num_threads(threads_before)


# ---- calibration from the last run -----------------------------------------------------------


def prior(model_config, flops: float = 50e9, bandwidth: float = 10e9,
          step_overhead_s: float = 2e-3) -> Calibration:
    """An uncalibrated cost model from the architecture alone (float32, an assumed machine of
    `flops` and `bandwidth`): only the ratios between coefficients matter once a run rescales
    it (calibration_from_run)."""
    from batchrun.footprint import parameter_count

    cfg = model_config
    head = cfg.vocab_size * cfg.hidden_size
    body = parameter_count(cfg) - head * (1 if cfg.tie_word_embeddings else 2)
    return Calibration(
        source="prior (uncalibrated)",
        step_s=step_overhead_s + 4 * (body + head) / bandwidth,
        token_s=2 * body / flops,
        context_s=4 * cfg.kv_bytes_per_token / bandwidth,
        pair_s=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim / flops,
        sample_s=2 * head / flops + 50e-6,
        request_s=200e-6)


def calibration_from_run(summary: dict, engine_config: EngineConfig, model_config,
                         base: Calibration | None = None) -> Calibration | None:
    """A Calibration fitted to a finished run's metrics summary (batch/metrics.py; what
    load_last_run returns works too): `base` (a micro-benchmark's, else the architecture's
    prior) scaled so that it predicts the run's wall time from the run's token counts and
    engine steps. None when the summary cannot calibrate (no completed request, no time)."""
    record = summary if "summary" not in summary else summary["summary"]
    try:
        wall = float(record["wall_time_s"])
        requests = record.get("requests", {})
        n = int(requests.get("ok", requests.get("total", 0)) if isinstance(requests, dict) else requests)
        shape = WorkloadShape.from_totals(n, int(record["prompt_tokens"]),
                                          int(record["completion_tokens"]),
                                          int(record.get("cached_tokens", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    if n <= 0 or wall <= 0 or not math.isfinite(wall):
        return None
    steps = (record.get("engine") or {}).get("steps") or None
    base = base or prior(model_config)
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
    return base.scaled(wall / predicted, source)
