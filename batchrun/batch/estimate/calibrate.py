"""The cost model's micro-benchmark: `calibrate()` times this engine on this machine for a
model's architecture (random weights, the decoder cut to 2 layers, every layer timed) and fits
the coefficients of batch/throughput.py's Calibration to the steps it recorded."""

from __future__ import annotations

import dataclasses
import itertools
import time

from batchrun.batch.estimate.throughput import Calibration
from batchrun.options.engine import EngineConfig


class _NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


# The most bytes a 2-layer MoE's routed experts may take in the benchmark: more experts are cut
# (each token still runs top-k of them, so the step does the same work).
BENCH_EXPERT_BYTES = 1 << 30


def _bench_model(model_cfg, layers: int, device, dtype, quantization: str = "none"):
    """(model, assumptions): a random-weight model of model_cfg's kind (the native model's own
    class: Llama, MoE; else transformers' model on the backend) with `layers` decoder layers,
    made ready for the engine as loading makes one (packed or quantized linears, CPU kernels),
    and what it assumed on the way."""
    import torch

    from batchrun.models.arch.llama import ModelConfig

    if not isinstance(model_cfg, ModelConfig):
        return _bench_backend(model_cfg, layers, device, dtype)
    from batchrun.models import quant
    from batchrun.models.arch import native
    from batchrun.models.layers import packed_linear
    from batchrun.models.quant.ready import attach_cpu_kernels, ready_linears, uses_float32_logits

    cfg, assumed = _bench_config(model_cfg, layers, torch.tensor([], dtype=dtype).element_size())
    with torch.device("meta"):
        model = native.native_module(cfg.hf_config).Model(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rope = type(model.rope)(cfg).to(device)
    _randomise(model, device)
    how = quant.method(quantization)
    if how.calibrates:  # as a calibrated load's layers (smoothed, outlier channels, int8 logits)
        from batchrun.models.quant import smoothquant

        maxima = {n: torch.ones(lin.in_features) for n, (lin, _) in smoothquant.targets(model).items()}
        if smoothquant.has_logits_layer(model):
            maxima[smoothquant.LOGITS] = torch.ones(cfg.hidden_size)
        smoothquant.smooth_and_quantize(model, maxima)
    # As llm.build_model does after loading the weights.
    kernels = None
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from batchrun.engine import kernels as cpu_kernels

        kernels = cpu_kernels.library(cpu_kernels.shape_flags(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    ready_linears(model, how, pack_float=device.type == "cpu" and packed_linear.available(dtype),
                  float32_logits=uses_float32_logits(kernels is not None, dtype))
    if kernels is not None:
        attach_cpu_kernels(model, kernels, how.quantizes)
    return model.eval(), assumed


def _bench_config(model_cfg, layers: int, elem: int):
    """model_cfg cut to `layers` layers (an MoE's routed experts cut to BENCH_EXPERT_BYTES, at
    least twice top-k), and the assumptions that makes."""
    cfg = dataclasses.replace(model_cfg, num_layers=layers)
    experts = getattr(cfg, "num_experts", 0)
    if not experts:
        return cfg, []
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size * elem * layers
    keep = max(min(experts, BENCH_EXPERT_BYTES // per_expert), min(experts, 2 * cfg.top_k))
    assumed = ["MoE routed by random router weights (about uniform over the experts)"]
    if keep < experts:
        cfg = dataclasses.replace(cfg, num_experts=keep)
        assumed.append(f"{keep} of {experts} experts built (top-{cfg.top_k} each token, as the "
                       f"model)")
    return cfg, assumed


def _randomise(model, device) -> None:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _bench_backend(model_cfg, layers: int, device, dtype):
    """transformers' model of model_cfg's text config with `layers` layers (one of each
    attention kind where the model mixes full and sliding-window layers), random weights, on
    the transformers backend as models/transformers/model.load makes it."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from batchrun.models.weights.remote_code import config_kwargs
    from batchrun.models.layers import packed_linear
    from batchrun.models.transformers import stateful
    from batchrun.models.transformers.model import pack, wrap

    text = copy.deepcopy(model_cfg.hf_config.get_text_config())
    assumed = ["transformers backend, random weights"]
    types = list(getattr(text, "layer_types", None) or [])
    keeps_state = stateful.runs(text)  # its layer kinds follow from other fields: first layers
    if keeps_state:
        assumed.append(f"the first {layers} layers timed (a recurrent model's own mix)")
    elif types:
        kinds = list(dict.fromkeys(types))
        text.layer_types = (kinds * layers)[:layers]
        if len(kinds) > 1:
            share = ", ".join(f"{types.count(k)} {k}" for k in kinds)
            assumed.append(f"one layer of each kind timed, scaled as the average ({share})")
    text.num_hidden_layers = layers
    hf = AutoModelForCausalLM.from_config(text, **config_kwargs(text)).to(device=device,
                                                                          dtype=dtype)
    model = stateful.wrap(hf.eval()) if keeps_state else wrap(hf.eval())
    if device.type == "cpu" and packed_linear.available(dtype):
        pack(model)
    return model, assumed


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
        model = runner.model
        for layer in getattr(model, "layers", None) or model.decoder.layers:
            setattr(layer, "forward", self._timed(layer.forward))  # an instance attribute

    def _timed(self, forward):
        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self._layer_s += time.perf_counter() - start

        return timed_forward


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
    the best of the non-negative unconstrained fits over the subsets of the columns that keep
    column 0, the intercept. A step (and a layer) always costs something fixed; without that
    column a noisy machine's fit can put all the time on the per-token terms, a 0 step cost."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    y = np.asarray(target, dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    a, y = a * w[:, None], y * w
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y ** 2))
    cols = range(1, a.shape[1])
    for k in range(a.shape[1]):
        for rest in itertools.combinations(cols, k):
            subset = (0,) + rest
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


def decoder_depth(model_config) -> int:
    """The decoder's layers: its KV layers (num_layers), but for a model with recurrent state
    on the transformers backend (its decoder_layers: a Mamba has no KV layers at all)."""
    if getattr(model_config, "state_bytes_per_sequence", 0):
        return model_config.decoder_layers
    return model_config.num_layers


def pair_token_ratio(model_config, inefficiency: float = 2.0) -> float:
    """Cost of one prefill attention (query, key) pair relative to one token's pass through a
    decoder layer's matmuls, from their FLOPs (footprint.compute: the layer's *active*
    parameters, top-k of an MoE's experts; QK^T and PV: 4 x heads x head_dim)."""
    from batchrun.footprint import compute

    cost = compute(model_config)
    return inefficiency * cost.attention_flops / cost.layer_flops


def calibrate(model_config, engine_config: EngineConfig | None = None,
              seconds: float = 3.0) -> Calibration:
    """Time this engine on this machine for `model_config`'s architecture (random weights,
    2 decoder layers, real vocabulary), within about `seconds`; see the module docstring."""
    import torch

    from batchrun.engine.engine import Engine
    from batchrun.engine.sampling_params import SamplingParams
    from batchrun.engine.devices import pick_device, pick_dtype
    from batchrun.llm import set_cpu_threads

    start = time.perf_counter()
    config = engine_config or EngineConfig.default()
    device = pick_device(config.device.device)
    dtype = pick_dtype(config.device.dtype, device)
    threads_before = torch.get_num_threads()
    if device.type == "cpu":  # as llm.load_from_path sets them
        set_cpu_threads(config)
    try:
        depth = decoder_depth(model_config)
        layers = min(2, depth)
        model, assumed = _bench_model(model_config, layers, device, dtype,
                                      config.device.quantization)
        sched = config.scheduler
        max_seqs = sched.max_num_seqs
        budget = sched.max_num_batched_tokens
        bs = config.cache.block_size
        max_len = min(config.max_model_len or model_config.max_position_embeddings,
                      model_config.max_position_embeddings)
        long_ctx = max(8, min(512, max_len - 64))
        num_blocks = max(64, (min(64, max_seqs) + 2) * -(-(long_ctx + 64) // bs))
        bench_config = config.model_copy(update={
            "cache": config.cache.model_copy(update={
                "num_blocks": num_blocks,
                "kv_cache_memory": None, "enable_prefix_caching": True}),
            "max_model_len": max_len})
        engine = Engine(model, _NoTokenizer(), bench_config, [], device, dtype, num_blocks,
                        max_len)
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
        elapsed = time.perf_counter() - start
        return Calibration(
            source=f"micro-benchmark ({elapsed:.1f} s, {len(recorder.rows)} steps, {layers}-layer "
                   f"random-weight model scaled to {depth} layers"
                   + "".join(f"; {a}" for a in assumed) + ")",
            step_s=rest[0] + depth * per_layer[0],
            token_s=rest[1] + depth * per_layer[1],
            context_s=depth * per_layer[2],
            pair_s=depth * per_layer[3],
            sample_s=rest[2],
            request_s=max(0.0, sorted(outside)[len(outside) // 2]) if outside else 0.0,
            details={"layers_timed": layers, "depth": depth, "per_layer": per_layer,
                     "outside_layers": rest, "steps": len(recorder.rows), "seconds": elapsed,
                     "threads": torch.get_num_threads(), "dtype": str(dtype),
                     "assumptions": assumed})
    finally:
        torch.set_num_threads(threads_before)
