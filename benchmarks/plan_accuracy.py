"""How close the plan's estimate comes to a real run: wall time and prefix-cache hit rate.

Renders an OpenAI batch file as the batch runner does, builds the WorkloadShape and the
PrefixSharing estimate, calibrates the throughput model with the micro-benchmark, then runs
the same lines through the batch runner (run_batch, as `batchrun run` does, model already
loaded) and prints estimate against measurement.

    python benchmarks/plan_accuracy.py ../shared/workloads/humaneval_chat.jsonl --limit 64

Two estimates are printed: with the requested max_tokens (what `batchrun plan` knows before the
run: an upper bound when requests stop at EOS) and with the completion lengths the run actually
produced (the throughput model alone). The run's metrics are also fed to calibration_from_run,
whose estimate of the same run is exact by construction; it is printed for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from batchrun import llm
from batchrun.batch.prefix_sharing import PrefixSharing
from batchrun.batch.runner import RunConfig, run_batch, serving_options
from batchrun.batch.throughput import (WorkloadShape, calibrate, calibration_from_run,
                                       concurrency, estimate_seconds, estimate_steps)
from batchrun.options.engine import EngineConfig
from batchrun.openai.serving import serving_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--seconds", type=float, default=3.0, help="micro-benchmark budget")
    ap.add_argument("--max-num-seqs", type=int)
    args = ap.parse_args()

    overrides = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    config = EngineConfig.default(**overrides)
    t0 = time.perf_counter()
    loaded = llm.load(None, config)
    engine = loaded.engine
    print(f"model loaded in {time.perf_counter() - t0:.1f} s; KV pool {engine.kv.num_blocks} blocks")

    with open(args.input) as f:
        lines = [line for line in f if line.strip()][:args.limit]
    run_config = RunConfig(input="", output="")
    serving = serving_for(loaded, serving_options(run_config))
    t0 = time.perf_counter()
    shape = WorkloadShape()
    sharing = PrefixSharing(config.cache.block_size, engine.kv.num_blocks)
    prompts = []
    for line in lines:
        raw = json.loads(line)
        prepared = serving.prepare(raw["url"], raw["body"], allow_stream=False)
        for prompt in prepared.prompts:
            room = loaded.max_model_len - len(prompt)
            max_tokens = room if prepared.params.max_tokens is None else prepared.params.max_tokens
            cached = sharing.add(prompt, max_tokens)
            shape.add(len(prompt), max_tokens, cached)
            prompts.append(len(prompt))
    render_s = time.perf_counter() - t0
    print(f"{len(lines)} lines rendered in {render_s:.2f} s: {shape.prompt_tokens} prompt tokens, "
          f"{shape.completion_tokens} requested completion tokens, "
          f"estimated hit rate {sharing.hit_rate:.1%}")

    t0 = time.perf_counter()
    cal = calibrate(engine.runner.model.config, config, args.seconds)
    print(f"calibration in {time.perf_counter() - t0:.1f} s: {cal.source}")
    print("  " + ", ".join(f"{k}={getattr(cal, k):.3g}" for k in
                           ("step_s", "token_s", "context_s", "pair_s", "sample_s", "request_s")))
    shape.host_seconds = render_s  # the runner renders each line too
    width = concurrency(shape, config, num_blocks=engine.kv.num_blocks)
    steps = estimate_steps(shape, config, num_blocks=engine.kv.num_blocks)
    est = estimate_seconds(shape, cal, config, num_blocks=engine.kv.num_blocks)
    print(f"estimate (requested max_tokens): {est:.1f} s, {steps} steps at concurrency {width}")

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.jsonl")
        with open(src, "w") as f:
            f.writelines(lines)
        out = os.path.join(tmp, "out.jsonl")
        summary = run_batch(loaded, RunConfig(input=src, output=out, progress="none"))
        actual = []
        with open(out) as f:
            for line in f:
                usage = json.loads(line)["response"]["body"]["usage"]
                actual.append(usage["completion_tokens"])
    wall = summary["wall_time_s"]
    stats = summary.get("engine", {})
    print(f"measured: {wall:.1f} s, {stats.get('steps')} steps, hit rate "
          f"{summary['cache_hit_rate']:.1%} ({summary['cached_tokens']} cached of "
          f"{summary['prompt_tokens']}), {summary['completion_tokens']} completion tokens")

    real = WorkloadShape(host_seconds=render_s)
    it = iter(actual)
    sharing2 = PrefixSharing(config.cache.block_size, engine.kv.num_blocks)
    for n in prompts:  # same prompts, actual lengths (sharing depends only on the prompts)
        g = next(it)
        real.add(n, g, 0)
    real.cached_tokens = sharing.cached_tokens
    real.prefill_pairs = shape.prefill_pairs
    est_real = estimate_seconds(real, cal, config, num_blocks=engine.kv.num_blocks)
    est_real_steps = estimate_seconds(real, cal, config, steps=stats.get("steps"))
    print(f"estimate (actual completion lengths): {est_real:.1f} s "
          f"({est_real / wall - 1:+.0%}); with the run's step count {est_real_steps:.1f} s "
          f"({est_real_steps / wall - 1:+.0%}); simulated steps "
          f"{estimate_steps(real, config, num_blocks=engine.kv.num_blocks)}")
    print(f"estimate (requested max_tokens) vs measured: {est / wall - 1:+.0%}")
    print(f"hit rate: estimated {sharing.hit_rate:.2%}, measured {summary['cache_hit_rate']:.2%}")
    from_run = calibration_from_run(summary, config, engine.runner.model.config, base=cal)
    if from_run is not None:
        print(f"calibration_from_run: {from_run.source}, scale {from_run.details['scaled_by']:.2f} "
              f"of the micro-benchmark's coefficients")


if __name__ == "__main__":
    sys.exit(main())
