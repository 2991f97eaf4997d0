"""Where an engine step's wall time goes, over a whole workload.

Wraps the hot calls of the CPU path (packed linears, the C kernels, prefill SDPA, RMSNorm, the
sampler) with wall-clock timers (benchmarks/step_timers.py), runs the workload greedily through
the engine, and prints each call's share of the total. The timers add a few microseconds per
call, so shares are approximate. It also counts the KV bytes attention reads from the paged
cache per step: what this run's path read, and what the legacy path (each decode sequence its
whole context, each prefill chunk a gathered copy of its cached context) reads for the same steps.

    python benchmarks/step_breakdown.py [WORKLOAD] [--dtype bfloat16] [--fewshot]
        [--fewshot-prefixes N] [--attention-kernel cascade|legacy] [--max-tokens N]
        [--quantization int8] [--kv-cache-dtype int8|fp8]

WORKLOAD defaults to the generated benchmarks/data/humaneval_chat.jsonl (benchmarks/workloads.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import batchrun.models.arch.llama as llama  # noqa: E402
from batchrun import llm  # noqa: E402
from batchrun.options.engine import EngineConfig  # noqa: E402
from batchrun.engine import SamplingParams  # noqa: E402
from benchmarks import step_timers  # noqa: E402
from benchmarks.bench import fewshot_workload, load_workload  # noqa: E402
from benchmarks.workloads import read_batch_file, workload_path  # noqa: E402


KV_ROWS = collections.Counter()  # KV rows (one token, all KV heads, K and V) read, all layers


def kv_rows_read(meta) -> tuple[int, int]:
    """(rows this layer's attention read from the paged cache, rows the legacy path reads)."""
    decode_lens = getattr(meta, "decode_lens", None)  # the kernel backends' metadata
    legacy = int(decode_lens.sum()) if decode_lens is not None else 0
    prefills = getattr(meta, "prefills", ())  # the batch-invariant backend's has none
    legacy += sum(c.ctx_len for c in prefills if c.ctx_len > c.q_len)
    if getattr(meta, "rows", None) is None:
        return legacy, legacy
    r, bs = meta.rows, meta.block_size
    read = sum(c.ctx_len for c in prefills if not c.in_kernel and c.ctx_len > c.q_len)
    lens = r.row_len[r.order.long()]
    group = torch.repeat_interleave(torch.arange(r.groups), (r.group_start[1:] - r.group_start[:-1]).long())
    shared = r.group_shared.long() * bs
    read += int(shared.sum()) + int((lens - shared[group]).sum())
    return read, legacy


def counting(fn):
    def wrapper(q, k, v, k_cache, v_cache, meta, *rest, **kwargs):
        read, legacy = kv_rows_read(meta)
        KV_ROWS["read"] += read
        KV_ROWS["legacy"] += legacy
        KV_ROWS["bytes per row"] = k_cache.shape[1] * k_cache.shape[2] * k_cache.element_size() * 2
        return fn(q, k, v, k_cache, v_cache, meta, *rest, **kwargs)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", help="chat batch JSONL [benchmarks/data/humaneval_chat.jsonl]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none", help="as batchrun's --quantization (int8, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as batchrun's --kv-cache-dtype (int8, fp8)")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--fewshot", action="store_true", help="the bench's few-shot sweep built from "
                    "WORKLOAD (a HumanEval chat batch file) instead of WORKLOAD itself")
    ap.add_argument("--fewshot-prefixes", type=int, default=20, help="with --fewshot: prefixes "
                    "(x 8 requests each)")
    ap.add_argument("--attention-kernel", default="cascade", choices=["cascade", "legacy"])
    ap.add_argument("--max-tokens", type=int, help="every request's max_tokens instead of the "
                    "workload's (1: the prompts' prefill alone)")
    args = ap.parse_args()
    if args.workload is None:
        args.workload = workload_path()
    read_batch_file(args.workload)  # a missing file stops here, before the model loads

    loaded = llm.load(None, EngineConfig.default(dtype=args.dtype,
                                                 attention_kernel=args.attention_kernel,
                                                 quantization=args.quantization,
                                                 kv_cache_dtype=args.kv_cache_dtype))
    engine = loaded.engine
    step_timers.install(engine)
    llama.paged_attention = counting(llama.paged_attention)

    if args.fewshot:
        work = fewshot_workload(args.workload, loaded.tokenizer, args.limit, args.fewshot_prefixes)
    else:
        work = load_workload(args.workload, loaded.tokenizer, args.limit)
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens or m) for m in work.max_tokens]
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    total = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(work.prompts)} requests, {generated} output tokens in {total:.1f} s "
          f"({generated / total:.1f} output tok/s), dtype {args.dtype}, quantization {args.quantization}, KV {args.kv_cache_dtype}, attention "
          f"{args.attention_kernel}")
    print(f"{'call':32}{'calls':>8}{'seconds':>10}{'share':>8}{'page faults':>13}")
    for name, sec in step_timers.SECONDS.most_common():
        print(f"{name:32}{step_timers.CALLS[name]:>8}{sec:>10.2f}{sec / total:>8.1%}"
              f"{step_timers.FAULTS[name]:>13}")
    rest = total - step_timers.SECONDS[step_timers.MODEL_STEP]
    print(f"{'engine outside the model step':32}{'':>8}{rest:>10.2f}{rest / total:>8.1%}")
    steps = step_timers.CALLS[step_timers.MODEL_STEP]
    mb = KV_ROWS["bytes per row"] / 1e6 / max(1, steps)
    print(f"KV read from the paged cache per step (all layers): {KV_ROWS['read'] * mb:.1f} MB "
          f"this path, {KV_ROWS['legacy'] * mb:.1f} MB the legacy path "
          f"({KV_ROWS['legacy'] / max(1, KV_ROWS['read']):.2f}x), over {steps} steps")


if __name__ == "__main__":
    main()
