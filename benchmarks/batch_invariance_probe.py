"""Where a request's numbers depend on its batch: one request (greedy, logprobs of the 20 best
tokens at every step) run alone and then inside a batch of 64, at another place in a batch,
after a prefix-cache hit on its prompt, and with its prefill chunked; prints the max |diff| of
its logprobs against the run alone and whether its tokens changed, with and without
--batch-invariant. Bundled SmolLM2-135M, float32 on the CPU.

    PYTHONPATH=$PWD python benchmarks/batch_invariance_probe.py [--max-tokens 8] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from batchrun import llm
from batchrun.engine.sampling_params import SamplingParams
from batchrun.options.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = Path("/work/shared/workloads/humaneval_chat.jsonl")


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    source = WORKLOAD if WORKLOAD.exists() else ROOT / "sample_data" / "chat.jsonl"
    texts = [json.loads(line)["body"]["messages"][-1]["content"]
             for line in source.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(texts[i % len(texts)] + f" ({i})")[:length] for i in range(count)]


def run(loaded, batch_invariant: bool, work: list[list[int]], target: int, params,
        warm: list[list[int]] = (), **overrides):
    """The target request's output when `work` runs as one batch (after `warm` ran first)."""
    config = EngineConfig.default(batch_invariant=batch_invariant, **overrides)
    engine = llm.build_engine(loaded.engine.runner.model, loaded.tokenizer, config,
                              loaded.eos_token_ids, torch.device("cpu"), torch.float32)
    if warm:
        engine.generate(warm, params)
    return engine.generate(work, params)[target]


def compare(ref, out) -> tuple[float, bool]:
    a, b = ref.outputs[0], out.outputs[0]
    diff = 0.0
    for x, y in zip(a.logprobs, b.logprobs):
        top_a, top_b = dict(x.top), dict(y.top)
        shared = set(top_a) & set(top_b)
        diff = max([diff, abs(x.logprob - y.logprob)] + [abs(top_a[t] - top_b[t]) for t in shared])
    return diff, a.token_ids != b.token_ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="each prompt cut to this")
    args = parser.parse_args(argv)
    from benchmarks.scoring import cpu_name

    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=20,
                            ignore_eos=True)
    for invariant in (False, True):
        loaded = llm.load(None, EngineConfig.default(batch_invariant=invariant))
        ps = prompts(loaded.tokenizer, 64, args.prompt_tokens)
        p = ps[0]
        alone = run(loaded, invariant, [p], 0, params)
        cases = {
            "in a batch of 64 (first)": run(loaded, invariant, ps, 0, params),
            "in a batch of 7 (last)": run(loaded, invariant, ps[1:7] + [p], 6, params),
            "after a prefix-cache hit": run(loaded, invariant, [p], 0, params, warm=[p[:-8]]),
            "prefill chunked by 32": run(loaded, invariant, [p], 0, params,
                                         max_num_batched_tokens=32),
        }
        mode = "--batch-invariant" if invariant else "default"
        for name, out in cases.items():
            diff, changed = compare(alone, out)
            print(f"{mode:<18} {name:<26} max|dlogprob| {diff:.3g}  tokens "
                  f"{'CHANGED' if changed else 'same'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
