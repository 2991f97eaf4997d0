"""Where an engine step's wall time goes, over a whole workload.

Wraps the hot calls of the CPU path (packed linears, the C kernels, prefill SDPA, RMSNorm, the
sampler) with wall-clock timers (benchmarks/step_timers.py), runs the workload greedily through the engine, and prints each call's share
of the total. The timers add a few microseconds per call, so shares are approximate.

    python benchmarks/step_breakdown.py [WORKLOAD] [--dtype bfloat16]

WORKLOAD defaults to the generated benchmarks/data/humaneval_chat.jsonl (benchmarks/workloads.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchrun import llm  # noqa: E402
from batchrun.options.engine import EngineConfig  # noqa: E402
from batchrun.engine import SamplingParams  # noqa: E402
from benchmarks import step_timers  # noqa: E402
from benchmarks.bench import load_workload  # noqa: E402
from benchmarks.workloads import read_batch_file, workload_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", help="chat batch JSONL [benchmarks/data/humaneval_chat.jsonl]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--limit", type=int)
    args = ap.parse_args()
    if args.workload is None:
        args.workload = workload_path()
    read_batch_file(args.workload)  # a missing file stops here, before the model loads

    loaded = llm.load(None, EngineConfig.default(dtype=args.dtype))
    engine = loaded.engine
    step_timers.install(engine)

    work = load_workload(args.workload, loaded.tokenizer, args.limit)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in work.max_tokens]
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    total = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(work.prompts)} requests, {generated} output tokens in {total:.1f} s "
          f"({generated / total:.1f} output tok/s), dtype {args.dtype}")
    print(f"{'call':32}{'calls':>8}{'seconds':>10}{'share':>8}")
    for name, sec in step_timers.SECONDS.most_common():
        print(f"{name:32}{step_timers.CALLS[name]:>8}{sec:>10.2f}{sec / total:>8.1%}")
    rest = total - step_timers.SECONDS[step_timers.MODEL_STEP]
    print(f"{'engine outside the model step':32}{'':>8}{rest:>10.2f}{rest / total:>8.1%}")


if __name__ == "__main__":
    main()
