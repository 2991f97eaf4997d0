"""The cost of --batch-invariant: the same workload with and without it, side by side in one
process (the bundled SmolLM2-135M, float32 on the CPU, greedy), alternating the two modes
`--repeats` times; prints each mode's output and total tokens/s and the invariant/default
ratio, with the CPU named.

    PYTHONPATH=$PWD python benchmarks/batch_invariant.py [--lines 32] [--max-tokens 32]
        [--workload /work/shared/workloads/humaneval_chat.jsonl] [--repeats 2] [--threads N]
        [--quantization int8]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock
from pathlib import Path

import torch

from batchrun import llm
from batchrun.engine.sampling_params import SamplingParams
from batchrun.options.engine import EngineConfig
from benchmarks.scoring import cpu_name
from benchmarks.workloads import read_batch_file

DEFAULT_WORKLOAD = "/work/shared/workloads/humaneval_chat.jsonl"
SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "chat.jsonl"


def prompts(tokenizer, path: str, count: int) -> list[list[int]]:
    lines = read_batch_file(path)[:count]
    return [tokenizer.apply_chat_template(line["body"]["messages"], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for line in lines]


def timed(loaded, work: list[list[int]], max_tokens: int) -> tuple[float, int, int]:
    """(seconds, prompt tokens, output tokens) of `work` on a fresh engine (empty cache)."""
    engine = llm.build_engine(loaded.engine.runner.model, loaded.tokenizer,
                              loaded.engine.config, loaded.eos_token_ids, torch.device("cpu"),
                              torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(work, params)
    seconds = time.perf_counter() - start
    return seconds, sum(map(len, work)), sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD if Path(DEFAULT_WORKLOAD).exists()
                    else str(SAMPLE))
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="--threads [default: all cores]")
    ap.add_argument("--quantization", default="none", help="--quantization of both modes")
    args = ap.parse_args(argv)
    both = dict(threads=args.threads, quantization=args.quantization)
    # W8A8 int8 runs batch-invariant unasked (models/invariance.py): the comparison turns that
    # default off for its "default" mode, or it would time the invariant path twice.
    with mock.patch.object(llm, "with_default_invariance", lambda path, config, device: config):
        default = llm.load(None, EngineConfig.default(**both))
    modes = {"default": default,
             "--batch-invariant": llm.load(None, EngineConfig.default(batch_invariant=True,
                                                                      **both))}
    assert not default.engine.config.batch_invariant, "the default mode ran invariant"
    work = prompts(modes["default"].tokenizer, args.workload, args.lines)
    totals = {name: [0.0, 0, 0] for name in modes}
    for _ in range(args.repeats):
        for name, loaded in modes.items():
            for i, v in enumerate(timed(loaded, work, args.max_tokens)):
                totals[name][i] += v
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}")
    print(f"workload: {args.lines} lines of {args.workload}, {args.max_tokens} output tokens "
          f"each, greedy; {args.repeats} alternating repeats; --quantization {args.quantization}")
    rates = {}
    for name, (seconds, prompt, output) in totals.items():
        rates[name] = ((prompt + output) / seconds, output / seconds)
        print(f"{name:<18} {seconds:7.1f} s  {rates[name][1]:7.1f} output tok/s  "
              f"{rates[name][0]:8.1f} total tok/s")
    ratio = rates["--batch-invariant"][0] / rates["default"][0]
    print(f"invariant / default throughput: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
