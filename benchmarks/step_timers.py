"""Wall-clock timers on the hot calls of an engine (packed and bfloat16 GEMM linears, the C kernels, prefill SDPA,
RMSNorm, the sampler, the model step), and the shares they add up to: what step_breakdown.py
prints call by call and bench.py per system (linear layers, attention, sampling, the engine
itself). Each timer adds a few microseconds per call, so shares are approximate.
"""

from __future__ import annotations

import collections
import resource
import time

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
# Minor page faults each call took: a first touch of fresh memory (a new activation buffer from
# mmap, a KV block never written before) costs microseconds a page, which is time in no kernel.
FAULTS: collections.Counter = collections.Counter()
MODEL_STEP = "model step (runner.execute)"
# Share groups: the calls each is made of (kernel ops by their names in engine/kernels/ops.py).
GROUPS = {
    "linear": ("linear (packed)", "linear (bf16 GEMM)", "linear (quantized)", "linear (bf16 logits)"),
    "attention": ("paged_decode_attention", "paged_attention", "cascade_groups", "kv_write",
                  "int8_kv_store", "prefill attention (SDPA)"),
    "sampling": ("sampler",),
}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[name] += time.perf_counter() - start
            CALLS[name] += 1
            FAULTS[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return wrapper


class TimedLibrary:
    """The kernel library (ops.CpuKernels) with every op timed."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return timed(name, getattr(self._lib, name))


_patched = False


def install(engine) -> None:
    """Time the calls of `engine` (and, once per process, the model classes' forward calls)."""
    global _patched
    import torch.nn.functional as F

    from batchrun.engine.attention import chunks, sdpa
    import batchrun.models.arch.llama as llama
    from batchrun.models.layers import packed_linear

    model = engine.runner.model
    kernels = getattr(model, "cpu_kernels", None)  # the transformers backend has none
    if kernels is not None and not isinstance(kernels, TimedLibrary):
        model.cpu_kernels = TimedLibrary(model.cpu_kernels)
        if getattr(engine.runner.attention, "lib", None) is not None:
            engine.runner.attention.lib = model.cpu_kernels
    if not _patched:
        _patched = True
        packed_linear.PackedLinear.forward = timed("linear (packed)", packed_linear.PackedLinear.forward)
        from batchrun.models.layers import bf16_gemm_linear, bf16_logits
        from batchrun.models.quant import bf16_linear, int4_linear, int8_linear

        gemm_forward = bf16_gemm_linear.Bf16GemmLinear.forward  # the logits layer's too
        bf16_gemm_linear.Bf16GemmLinear.forward = timed("linear (bf16 GEMM)", gemm_forward)
        bf16_logits.Bf16LogitsLinear.forward = timed("linear (bf16 logits)", gemm_forward)

        for cls in (int8_linear.Int8Linear, int8_linear.Int8WeightLinear,
                    int4_linear.Int4WeightLinear, bf16_linear.Bf16Linear):
            cls.forward = timed("linear (quantized)", cls.forward)
        timed_sdpa = type("F", (), {"scaled_dot_product_attention": staticmethod(
            timed("prefill attention (SDPA)", F.scaled_dot_product_attention))})
        chunks.F = sdpa.F = timed_sdpa
        llama.F.rms_norm = timed("rms_norm", F.rms_norm)
    engine.runner.execute = timed(MODEL_STEP, engine.runner.execute)
    engine.sampler = engine.updater.sampler = _TimedSampler(engine.sampler)


class _TimedSampler:
    def __init__(self, sampler):
        self._sampler = sampler
        self._call = timed("sampler", sampler.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def reset() -> None:
    SECONDS.clear()
    CALLS.clear()
    FAULTS.clear()


def shares(total: float) -> dict[str, float]:
    """Fractions of `total` seconds: linear, attention, sampling, the rest of the model step
    (norms, RoPE, KV writes, batch preparation) and the engine outside the model step and the
    sampler (scheduling, detokenising, and for a CLI run: reading, rendering, committing)."""
    out = {g: sum(SECONDS[n] for n in names) / total for g, names in GROUPS.items()}
    step = SECONDS[MODEL_STEP]
    inside = sum(SECONDS[n] for n in (*GROUPS["linear"], *GROUPS["attention"]))
    out["model other"] = (step - inside) / total
    out["engine"] = (total - step - SECONDS["sampler"]) / total
    return out


def shares_table(results) -> str:
    """Per system with timers: the share of its seconds in each group."""
    names = [*GROUPS, "model other", "engine"]
    lines = [f"{'time shares':<22}" + "".join(f"{n:>13}" for n in names)]
    for r in results:
        if not r.timers:
            continue
        SECONDS.clear()
        SECONDS.update(r.timers)
        row = shares(r.seconds)
        lines.append(f"{r.system:<22}" + "".join(f"{row[n]:>13.1%}" for n in names))
    SECONDS.clear()
    return "\n".join(lines)
