"""The native model files against the transformers backend (and, with --hf-static, against
transformers' own generate on static batches of 32) on the same random weights, side by side in
one process, on a slice of the HumanEval chat workload.

    python benchmarks/native_vs_backend.py --limit 16                 # Gemma 2 and Phi-3
    python benchmarks/native_vs_backend.py --families gemma3 --limit 32 --max-tokens 64
    python benchmarks/native_vs_backend.py --families llama,gemma2,phi3,qwen3moe,olmo2 \
        --hf-static --limit 64 --max-tokens 32 --ignore-eos      # issue 25's table

Each family is a random-weight checkpoint of a realistic small size (about 140-230M parameters,
SmolLM2's tokenizer and chat template), built once under $BATCHRUN_CACHE/bench-models. Gemma 2's
sliding layers get a 128-token window, so the HumanEval prompts (150-300 tokens) cross it and
the windowed layers do real work. A family without a native model file (OLMo 2) runs on the
backend only. Every system runs greedy decoding on the same rendered prompts (with
--ignore-eos, every request to its max_tokens: random weights end at arbitrary places);
"same as first" is the share of requests whose tokens equal the first system's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench import (load_workload, machine_line, report, run_batchrun,  # noqa: E402
                              run_hf_static)
from benchmarks.workloads import workload_path  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=64, sliding_window=128, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=64, sliding_window=128, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=2047, original_max_position_embeddings=4096, tie_word_embeddings=False)),
    # 8 experts of 768, top 2: 227M parameters.
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
        tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=True)),  # backend only
}


def build_checkpoint(family: str):
    """The random-weight checkpoint of `family` (built on first use) with SmolLM2's tokenizer."""
    import transformers

    from batchrun.models.weights.resolve import resolve_model
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


def systems_of(path, hf_static: bool) -> list[str]:
    """The systems a family runs: native where a native model file takes it, the backend, and
    transformers' static batches."""
    import transformers

    from batchrun.models.arch.native import native_reason

    native = native_reason(transformers.AutoConfig.from_pretrained(path)) is None
    return (["native"] if native else []) + ["transformers"] + (["hf-static"] if hf_static else [])


def run_system(system: str, loaded: dict, work, label: str, ignore_eos: bool):
    if system == "hf-static":
        eos = loaded["transformers"].tokenizer.eos_token_id
        return run_hf_static(loaded[system], work, eos, ignore_eos=ignore_eos)
    return run_batchrun(loaded[system], work, label, ignore_eos)


def load_systems(path, systems: list[str], base: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from batchrun import llm
    from batchrun.options.engine import EngineConfig

    return {s: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            if s == "hf-static" else llm.load(str(path), EngineConfig.default(model_impl=s, **base))
            for s in systems}


RATIOS = [("native", "transformers"), ("transformers", "hf-static"), ("native", "hf-static")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", help="chat batch JSONL [the HumanEval chat workload: "
                    "benchmarks/data/humaneval_chat.jsonl, built on first use]")
    ap.add_argument("--families", default="gemma2,phi3", help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--limit", type=int, default=16, help="first N HumanEval requests")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens")
    ap.add_argument("--ignore-eos", action="store_true", help="every request runs to its "
                    "max_tokens in every system (forced lengths)")
    ap.add_argument("--hf-static", action="store_true", help="also transformers generate on "
                    "left-padded static batches of 32 (the bench's baseline)")
    ap.add_argument("--rounds", type=int, default=2, help="the systems' runs alternate this "
                    "many times (a shared machine's load drifts; the median ratio is reported)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    from batchrun.engine import SamplingParams

    base = {"threads": args.threads} if args.threads else {}
    summary = []
    for family in args.families.split(","):
        path = build_checkpoint(family)
        systems = systems_of(path, args.hf_static)
        loaded = load_systems(path, systems, base)
        work = load_workload(args.workload or workload_path("humaneval_chat.jsonl"),
                             loaded["transformers"].tokenizer, args.limit)
        if args.max_tokens:
            work.max_tokens = [min(m, args.max_tokens) for m in work.max_tokens]
        for system in systems:  # first calls (oneDNN, kernels) outside the timing
            if system != "hf-static":
                loaded[system].engine.generate(work.prompts[:2],
                                               SamplingParams(temperature=0, max_tokens=4))
        results, tps, cpu = [], {s: [] for s in systems}, {s: [] for s in systems}
        for r in range(args.rounds):
            for system in systems:
                start = time.process_time()
                results.append(run_system(system, loaded, work, f"{family}-{system}-{r + 1}",
                                          args.ignore_eos))
                results[-1].system = f"{family}-{system}-{r + 1}"
                cpu[system].append(time.process_time() - start)
                tps[system].append(results[-1].output_tps)
                print(f"  {results[-1].system}: {tps[system][-1]:.1f} output tok/s, "
                      f"{cpu[system][-1]:.1f} CPU s", file=sys.stderr)
        print(f"{family}: {parameter_count(path) / 1e6:.0f}M parameters, {len(work.prompts)} "
              f"requests, {sum(map(len, work.prompts))} prompt tokens, max_tokens "
              f"{max(work.max_tokens)}{' (forced)' if args.ignore_eos else ''}")
        print(report(results, baseline=f"{family}-{systems[-1]}-1"))
        row = {}
        for a, b in RATIOS:
            if a in tps and b in tps:
                ratios = [x / y for x, y in zip(tps[a], tps[b])]
                cpu_ratios = [y / x for x, y in zip(cpu[a], cpu[b])]
                row[(a, b)] = statistics.median(ratios)
                print(f"{a} / {b}, output tok/s, per round: "
                      f"{', '.join(f'{x:.2f}x' for x in ratios)}; median {row[(a, b)]:.2f}x "
                      f"(CPU seconds {b} / {a}: median {statistics.median(cpu_ratios):.2f}x)")
        print()
        summary.append((family, parameter_count(path), row))
        del loaded
    print(f"{'family':<10}{'params':>8}" + "".join(f"{a + ' / ' + b:>26}" for a, b in RATIOS))
    for family, params, row in summary:
        print(f"{family:<10}{params / 1e6:>7.0f}M" + "".join(
            f"{f'{row[k]:.2f}x' if k in row else '-':>26}" for k in RATIOS))
    print(f"medians of {args.rounds} rounds, output tok/s; targets: native / transformers >= "
          f"1.3x, transformers / hf-static >= 2x")
    print(f"torch threads {torch.get_num_threads()}")
    print(machine_line())


if __name__ == "__main__":
    main()
