"""The native model files against the transformers backend on the same random weights, side by
side in one process, on a slice of the HumanEval chat workload.

    python benchmarks/native_vs_backend.py --limit 16                 # Gemma 2 and Phi-3
    python benchmarks/native_vs_backend.py --families gemma3 --limit 32 --max-tokens 64

Each family is a random-weight checkpoint of a realistic small size (about 140-180M parameters,
SmolLM2's tokenizer and chat template), built once under $BATCHRUN_CACHE/bench-models. Gemma 2's
sliding layers get a 128-token window, so the HumanEval prompts (150-300 tokens) cross it and
the windowed layers do real work. Both systems run greedy decoding on the same rendered prompts;
"same as first" is the share of requests whose tokens equal the native path's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench import load_workload, machine_line, report, run_batchrun  # noqa: E402
from benchmarks.workloads import workload_path  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=64, sliding_window=128, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=64, sliding_window=128, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=2047, original_max_position_embeddings=4096, tie_word_embeddings=False)),
}


def build_checkpoint(family: str):
    """The random-weight checkpoint of `family` (built on first use) with SmolLM2's tokenizer."""
    import transformers

    from batchrun.models.resolve import resolve_model
    from batchrun.paths import cache_dir

    path = cache_dir() / "bench-models" / family
    if (path / "model.safetensors").exists():
        return path
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(vocab_size=len(tokenizer), **SHAPE, **extra)
    cfg.bos_token_id, cfg.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    cfg.pad_token_id = tokenizer.pad_token_id or 0
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def parameter_count(path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", help="chat batch JSONL [the HumanEval chat workload: "
                    "benchmarks/data/humaneval_chat.jsonl, built on first use]")
    ap.add_argument("--families", default="gemma2,phi3", help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--limit", type=int, default=16, help="first N HumanEval requests")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens")
    ap.add_argument("--rounds", type=int, default=2, help="native and backend runs alternate this "
                    "many times (a shared machine's load drifts; the median ratio is reported)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    from batchrun import llm
    from batchrun.engine import SamplingParams
    from batchrun.options.engine import EngineConfig

    base = {"threads": args.threads} if args.threads else {}
    for family in args.families.split(","):
        path = build_checkpoint(family)
        loaded = {impl: llm.load(str(path), EngineConfig.default(model_impl=impl, **base))
                  for impl in ("native", "transformers")}
        work = load_workload(args.workload or workload_path("humaneval_chat.jsonl"),
                             loaded["native"].tokenizer, args.limit)
        if args.max_tokens:
            work.max_tokens = [min(m, args.max_tokens) for m in work.max_tokens]
        for engine_of in loaded.values():  # first calls (oneDNN, kernels) outside the timing
            engine_of.engine.generate(work.prompts[:2], SamplingParams(temperature=0, max_tokens=4))
        results, ratios, cpu_ratios = [], [], []
        for r in range(args.rounds):
            pair, cpu = [], []
            for impl in ("native", "transformers"):
                start = time.process_time()
                pair.append(run_batchrun(loaded[impl], work, f"{family}-{impl}-{r + 1}"))
                cpu.append(time.process_time() - start)
                print(f"  {pair[-1].system}: {pair[-1].output_tps:.1f} output tok/s, "
                      f"{cpu[-1]:.1f} CPU s", file=sys.stderr)
            ratios.append(pair[0].output_tps / pair[1].output_tps)
            cpu_ratios.append(cpu[1] / cpu[0])
            results += pair
        print(f"{family}: {parameter_count(path) / 1e6:.0f}M parameters, {len(work.prompts)} "
              f"requests, {sum(map(len, work.prompts))} prompt tokens, max_tokens "
              f"{max(work.max_tokens)}")
        print(report(results, baseline=f"{family}-transformers-1"))
        print(f"native / transformers backend, output tok/s, per round: "
              f"{', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x")
        print(f"backend / native CPU seconds (this process's, steadier than wall time on a busy "
              f"machine), per round: {', '.join(f'{x:.2f}x' for x in cpu_ratios)}; median "
              f"{statistics.median(cpu_ratios):.2f}x\n")
        del loaded
    print(f"torch threads {torch.get_num_threads()}")
    print(machine_line())


if __name__ == "__main__":
    main()
