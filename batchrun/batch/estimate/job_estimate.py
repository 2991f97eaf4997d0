"""`batchrun plan`: what a run of a JobPlan would do, before it does it, without its weights.

One streaming pass over the inputs, exactly as the run reads them: each line is validated and
rendered with the model's chat template and tokenizer (the run's own prepare_line), its
prompt tokens counted, its requested completion tokens (max_tokens x choices, or the room left
in the context) added up, and its prompts replayed through a model of the prefix cache
(batch/prefix_sharing.py: what the cache will serve). Memory stays flat: per line only the
duplicate check's 16 bytes and the cache model's bounded LRU.

Then the sizes (footprint.py: weights, the KV pool the engine will reserve) and the
time (batch/throughput.py: a cost model of this engine, calibrated by the last run of this
model on this machine, or by a few-second micro-benchmark of the engine on a 2-layer copy of
the architecture).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from batchrun.batch.storage import io
from batchrun.batch.job.plan import BatchConfigError, JobPlan
from batchrun.batch.estimate.prefix_sharing import PrefixSharing
from batchrun.batch.job.progress import format_duration
from batchrun.batch.job.runner import prepare_line
from batchrun.batch.estimate.throughput import WorkloadShape
from batchrun.batch.job.validate import validate
from batchrun.engine.kv_groups import kv_block_bytes, kv_groups
from batchrun.footprint import tokenizer_model
from batchrun.models.arch.llama import ModelConfig
from batchrun.openai.prepared import POOLED
from batchrun.openai.serving import OpenAIServing
from batchrun.options.engine import EngineConfig
from batchrun.served_model import ServedModel

CALIBRATIONS = ("auto", "last-run", "benchmark")


@dataclass
class Estimate:
    inputs: list[dict[str, Any]]  # path, format, bytes
    start: str  # the plan's resume decision
    model: str
    committed: int = 0  # lines an interrupted run committed (resume, undecided)
    staging: str | None = None
    busy: str | None = None  # another run holds the output (start "busy")
    lines: int = 0
    valid: int = 0
    invalid: int = 0
    invalid_by_code: dict[str, int] = field(default_factory=dict)
    requests: int = 0  # engine requests (a completions line may have several prompts)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, what the prefix cache would serve
    requested_completion_tokens: int = 0
    fill_context: int = 0  # requests with no max_tokens: their room in the context is counted
    expected_completion_tokens: int | None = None  # scaled by the last run's generated share
    scan_seconds: float = 0.0
    weights_bytes: int = 0
    tied_logits_copy_bytes: int = 0  # of weights_bytes: the logits' packed copy of tied embeddings
    weights_dtype: str = ""
    model_path: str = ""  # native | transformers (the path --model-impl picks)
    parameters: int = 0
    active_parameters: int = 0  # per token: top-k of an MoE's routed experts
    experts: str = ""  # "E experts, k per token"; "" for a dense model
    flops_per_token: int = 0  # through the decoder layers' weights; the logits come on top
    logits_flops_per_token: int = 0  # per sampled token
    kv_groups: list[dict[str, Any]] = field(default_factory=list)  # window, layers, bytes/token
    kv_blocks: int = 0
    kv_bytes: int = 0
    block_size: int = 16
    concurrency: int = 0  # requests running at once (max_num_seqs, in-flight window, KV room)
    estimated_seconds: float | None = None
    # Where the run's time likely falls, and how sure that is (batch/estimate/confidence.py).
    estimated_seconds_low: float | None = None
    estimated_seconds_high: float | None = None
    confidence: str = ""  # low | medium | high
    confidence_basis: str = ""
    calibration: str = ""
    assumptions: list[str] = field(default_factory=list)  # what the sizes and times assume

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cache_hit_rate": self.cache_hit_rate}


def scan(plan: JobPlan, model: ServedModel, sharing: PrefixSharing, shape: WorkloadShape,
         share: float = 1.0, model_config: Any = None) -> Estimate:
    """The streaming pass: line counts, tokens, prefix sharing (into `sharing` and `shape`).
    `share`: the fraction of the requested completion tokens a request is expected to generate
    (1 = all of them; the last run's share when it stopped early). `model_config`
    (footprint.model_config_for) places a vision-language model's image spans."""
    estimate = Estimate(inputs=[{"path": s.path, "format": str(s.format), "bytes": size}
                                for s, (_, size, _) in zip(plan.sources, plan.fingerprint)],
                        start=plan.start, model=model.name, block_size=sharing.block_size,
                        committed=plan.committed, staging=plan.targets.staging, busy=plan.busy)
    try:
        serving = OpenAIServing(model, plan.serving)
    except ValueError as exc:  # an option the model cannot take (--score-tokens)
        raise BatchConfigError(str(exc)) from exc
    context = model.max_model_len
    codes: Counter = Counter()

    def prepare(text: str, line: int):
        prepared = prepare_line(text, line, serving)
        params = prepared.params
        max_tokens = params.max_tokens
        assert max_tokens is not None  # prepare_line resolves every line's max_tokens
        key = image_block_key(model_config, prepared)
        for prompt in prepared.request.prompts:
            requested = min(max_tokens, context - len(prompt)) * params.n
            completion = max(1, round(requested * share)) if requested else 0
            shape.add(len(prompt), completion, sharing.add(prompt, completion, key))
            estimate.requests += 1
        estimate.requested_completion_tokens += max_tokens * params.n * \
            len(prepared.request.prompts)
        if _fills_context(prepared):
            estimate.fill_context += 1
        return prepared

    report = validate(list(plan.sources), prepare, lambda item, exc: codes.update([exc.code]),
                      plan.storage, plan.inputs.columns)
    estimate.lines, estimate.valid = report.lines, report.valid
    estimate.invalid, estimate.invalid_by_code = report.invalid, dict(codes.most_common())
    estimate.prompt_tokens, estimate.cached_tokens = shape.prompt_tokens, shape.cached_tokens
    estimate.scan_seconds = report.seconds
    return estimate


def image_block_key(model_config: Any, prepared: Any) -> Callable[[int, int], bytes] | None:
    """The prefix-cache key the engine mixes into the blocks over a prompt's images (the
    placeholder ids are the same for every picture), its spans placed from the config as the
    model places them; None for a prompt without images."""
    images = prepared.request.multimodal
    if images is None:
        return None
    from batchrun.models.transformers.vision import place_spans

    place_spans(model_config.hf_config, prepared.request.prompts[0], images)
    return images.block_key


def _fills_context(prepared: Any) -> bool:
    if prepared.request.kind in POOLED:  # prefill only: nothing to generate
        return False
    request = prepared.request.request
    return getattr(request, "max_tokens", None) is None and \
        getattr(request, "max_completion_tokens", None) is None


def estimate_plan(plan: JobPlan, calibration: str = "auto",
                  on_stage: Callable[[str], None] = lambda text: None) -> Estimate:
    """Everything `batchrun plan` prints. `calibration`: auto (the recent runs of this model on
    this machine that did enough work, confidence.calibrating_runs, else the micro-benchmark),
    last-run (fail over to the benchmark with a note), benchmark."""
    from batchrun.batch.estimate import calibrate, confidence, run_store, throughput
    from batchrun import footprint, memory_fit

    spec = plan.inputs.model
    on_stage("reading the model's config and tokenizer (not its weights)")
    engine = plan.engine
    cfg = footprint.model_config_for(spec, engine.model_impl, engine.trust_remote_code)
    memory_fit.check_fits(cfg, engine, spec)  # WontFitError before a calibration allocates
    model = tokenizer_model(spec, engine.max_model_len, engine.trust_remote_code)
    blocks, kv_bytes = footprint.kv_reservation(engine, cfg)
    groups = kv_groups(cfg)
    sharing = prefix_model(engine, cfg, blocks // len(groups.groups))
    key = run_key(model.name, engine)
    recorded = run_store.load_runs(key) if calibration in ("auto", "last-run") else []
    runs, passed_over = confidence.calibrating_runs(recorded)
    last = runs[0] if runs else None
    summary = (last or {}).get("summary", {})
    generated, requested = summary.get("completion_tokens"), \
        summary.get("requested_completion_tokens")
    # Requests stop early (EOS); as the last run did, in proportion.
    share = min(1.0, generated / requested) if generated and requested else 1.0

    shape = WorkloadShape()
    on_stage("scanning the inputs")
    estimate = scan(plan, model, sharing, shape, share, cfg)
    if share < 1.0:
        estimate.expected_completion_tokens = shape.completion_tokens
    from batchrun.models.quant import method

    quantization = engine.device.quantization
    how = method(quantization)
    kept = None
    if how.needs_gguf:
        from batchrun.models.config.spec_config import gguf_file

        kept = gguf_file(spec)
    estimate.weights_bytes = footprint.weights_bytes(cfg, engine.device.dtype,
                                                     quantization=quantization, gguf=kept)
    estimate.weights_dtype = _dtype_name(engine, cfg)
    if not how.quantizes:
        estimate.tied_logits_copy_bytes = footprint.tied_logits_copy_bytes(
            cfg, engine.device.dtype, engine.device.device)
    estimate.kv_blocks, estimate.kv_bytes = blocks, kv_bytes
    describe_model(estimate, cfg, engine, groups)
    # The pool as the estimator's blocks of full-attention tokens: a request of the mean length
    # holds kv_groups.blocks_per_sequence pool blocks (a window group's capped at its window).
    mean = max(1, round(shape.mean_prompt_tokens + shape.mean_completion_tokens))
    bs = engine.cache.block_size
    blocks = blocks * -(-mean // bs) // max(1, groups.blocks_per_sequence(
        mean, bs, engine.scheduler.max_num_batched_tokens))
    estimate.concurrency = throughput.concurrency(shape, engine, plan.max_in_flight, blocks)

    def seconds(cal) -> float:
        return throughput.estimate_seconds(shape, cal, engine, max_in_flight=plan.max_in_flight,
                                           num_blocks=blocks)

    cals = [c for c in (throughput.calibration_from_run(
        r, engine, cfg, max_in_flight=plan.max_in_flight, num_blocks=blocks) for r in runs)
        if c is not None]
    if cals:
        times = [seconds(c) for c in cals]
        cal, span = cals[0], confidence.from_runs(times)
    else:
        on_stage("calibrating: a few seconds of this engine on a 2-layer copy of the model")
        cal = calibrate.calibrate(cfg, engine)
        why = passed_over or ("--calibration benchmark" if calibration == "benchmark" else
                              f"no run of {model.name} on this machine yet")
        if calibration == "last-run":
            cal = cal.scaled(1.0, f"{cal.source}; {why}")
        span = confidence.from_benchmark(seconds(cal), why)
    estimate.calibration = cal.source
    estimate.assumptions += cal.details.get("assumptions", [])
    estimate.estimated_seconds = seconds(cal)
    estimate.estimated_seconds_low, estimate.estimated_seconds_high = span.low, span.high
    estimate.confidence, estimate.confidence_basis = span.confidence, span.basis
    return estimate


def describe_model(estimate: Estimate, cfg: Any, engine: EngineConfig, groups: Any) -> None:
    """The model's compute (footprint.compute) and KV groups into `estimate`, with what the
    figures assume."""
    from batchrun import footprint
    from batchrun.engine.devices import pick_device, pick_dtype
    device = pick_device(engine.device.device)
    from batchrun.llm import kv_layout_for

    _, _, kv_dtype = kv_layout_for(engine, cfg, device, pick_dtype(engine.device.dtype, device))
    cost = footprint.compute(cfg)
    estimate.model_path = "native" if isinstance(cfg, ModelConfig) else "transformers"
    estimate.parameters, estimate.active_parameters = cost.parameters, cost.active_parameters
    estimate.flops_per_token, estimate.logits_flops_per_token = cost.layer_flops, cost.logits_flops
    if cost.experts:
        estimate.experts = f"{cost.experts} experts, {cost.experts_per_token} per token"
        estimate.assumptions.append("MoE FLOPs count top-k of the routed experts per token")
    # One pool block holds layers_per_block layers' K and V of the group that owns it.
    per_token = kv_block_bytes(cfg, 1, kv_dtype.itemsize, 4 if str(kv_dtype) == "torch.int8" else 0)
    estimate.kv_groups = [{"window": g.window, "chunked": g.chunked, "layers": len(g.layers),
                           "bytes_per_token": per_token} for g in groups.groups]
    if any(g.window for g in groups.groups):
        estimate.assumptions.append("a sliding-window (or chunked-attention) group holds a "
                                    "request's KV over its window (chunk) only; the prefix-cache "
                                    "replay counts each cached block once per KV group")
    if estimate.model_path == "transformers":
        estimate.assumptions.append("KV shape and windows read by a forward pass of "
                                    "transformers' model on the meta device (no weights)")


def run_key(model_name: str, engine: EngineConfig) -> str:
    """What a run's calibration is kept under (with the machine: run_store.save_run)."""
    key = f"{model_name}|{engine.device.dtype}|kv={engine.cache.kv_cache_dtype}"
    from batchrun.models.quant import method

    quantization = engine.device.quantization
    return f"{key}|q={quantization}" if method(quantization).quantizes else key


def _dtype_name(engine: EngineConfig, cfg) -> str:
    """The dtype the weights will have here (auto: float32 on the CPU, bfloat16 on CUDA), and
    the format of a checkpoint stored quantized."""
    from batchrun.engine.devices import pick_device, pick_dtype
    from batchrun.models.quant.precision import Precision

    name = str(pick_dtype(engine.device.dtype, pick_device(engine.device.device))).split(".")[-1]
    precision = Precision.of(cfg.hf_config, engine.device.quantization)
    how, stored = precision.method, precision.stored
    if stored is not None:
        into = f" requantized to {how.name}" if how.quantizes else ""
        return f"{stored.describe()} {stored.holds}{into}, the rest {name}"
    return f"{name}, {how.name} linears" if how.quantizes else name


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _flops(n: int) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} FLOP"


def _kv_groups(groups: list[dict[str, Any]]) -> str:
    """Per KV group: its layers, what a token's K and V take, and its window."""
    return ", ".join(f"{g['layers']} layers "
                     f"{'full' if g['window'] is None else 'window ' + str(g['window'])} "
                     f"{_size(g['bytes_per_token'])}/token" for g in groups)


def report_text(e: Estimate) -> str:
    names = ", ".join("stdin" if i["path"] == io.STDIO else i["path"] for i in e.inputs[:3])
    names += f" and {len(e.inputs) - 3} more" if len(e.inputs) > 3 else ""
    size = sum(i["bytes"] or 0 for i in e.inputs)
    invalid = ", ".join(f"{code}: {n}" for code, n in e.invalid_by_code.items())
    rate = e.lines / e.scan_seconds if e.scan_seconds > 0 else 0.0
    completion = f"{e.requested_completion_tokens:,} requested"
    if e.fill_context:
        completion += f" ({e.fill_context:,} lines without max_tokens count their context room)"
    if e.expected_completion_tokens is not None:
        completion += f", ~{e.expected_completion_tokens:,} expected (as the last run stopped early)"
    starts = {"fresh": "a fresh start",
              "resume": f"resume: {e.committed:,} committed lines are kept, the rest run",
              "done": "nothing: this job already completed over the same inputs",
              "undecided": f"nothing yet: {e.staging} holds {e.committed:,} committed lines of "
                           "an interrupted run; with --resume a run would keep them and run "
                           "only the rest, with --restart it would discard them",
              "busy": f"nothing now: {e.busy}",
              "unknown": "(give -o to see whether it starts afresh or resumes)"}
    lines = [
        f"inputs      {len(e.inputs)} file(s), {_size(size)}: {names}",
        f"lines       {e.lines:,}: {e.valid:,} valid, {e.invalid:,} invalid"
        + (f" ({invalid})" if invalid else "") + f"  [scanned at {rate:,.0f} lines/s]",
        f"model       {e.model}; {e.requests:,} engine requests",
        f"prompt      {e.prompt_tokens:,} tokens (mean "
        f"{e.prompt_tokens / max(e.requests, 1):,.0f}), {e.cached_tokens:,} from the prefix "
        f"cache: expected hit rate {e.cache_hit_rate:.1%}",
        f"completion  {completion}",
        f"weights     {_size(e.weights_bytes)} held ({e.weights_dtype}; {e.model_path} path): "
        f"{e.parameters:,} parameters" + (f", {e.active_parameters:,} active per token "
                                          f"({e.experts})" if e.experts else "")
        + (f"; {_size(e.tied_logits_copy_bytes)} of it the logits' packed copy of the tied "
           "embeddings" if e.tied_logits_copy_bytes else ""),
        f"compute     {_flops(e.flops_per_token)} per token through the layers, "
        f"{_flops(e.logits_flops_per_token)} per sampled token for the logits",
        f"KV cache    {_size(e.kv_bytes)} reserved ({e.kv_blocks:,} blocks of {e.block_size} "
        f"tokens; {_kv_groups(e.kv_groups)}); ~{e.concurrency:,} requests at once",
        f"wall time   ~{format_duration(e.estimated_seconds or 0)} estimated, likely "
        f"{format_duration(e.estimated_seconds_low or 0)}-"
        f"{format_duration(e.estimated_seconds_high or 0)} (calibrated by {e.calibration})",
        f"confidence  {e.confidence}: {e.confidence_basis}",
        f"a run does  {starts[e.start]}",
    ]
    lines += [f"assumes     {a}" for a in e.assumptions]
    return "\n".join(lines)


def prefix_model(engine, cfg, capacity_blocks: int) -> PrefixSharing:
    """The engine's prefix cache as the estimate replays it: blocks of prompt tokens (one pool
    block in each KV group: capacity_blocks per group), or for a model with recurrent state
    its state checkpoints (engine/state_checkpoints.py: a hit ends at one, so the unit is the
    checkpoint interval and the capacity the checkpoints kept; none: no hits)."""
    import torch

    from batchrun.engine.kv_sizing import checkpoint_interval, state_checkpoint_count

    if not getattr(cfg, "state_bytes_per_sequence", 0):
        return PrefixSharing(engine.cache.block_size, capacity_blocks,
                             enabled=engine.cache.enable_prefix_caching)
    kept = state_checkpoint_count(engine, cfg, torch.device("cpu"))  # as kv_reservation sizes
    return PrefixSharing(checkpoint_interval(engine), kept, enabled=kept > 0)
