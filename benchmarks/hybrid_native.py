"""Native Qwen3-Next (models/arch/qwen3_next.py) against the transformers backend and
transformers' own generate on static batches of 32, on a random-weight Qwen3-Next-shaped model
of about 300M parameters (SmolLM2's tokenizer and chat template), on a slice of the HumanEval
chat workload; then the native path's decode cost per token against the context length.

    python benchmarks/hybrid_native.py --limit 4 --max-tokens 16 --contexts ""   # ~3 min, 2 cores
    python benchmarks/hybrid_native.py --systems "" --contexts 64,512,2048 --threads 1

The model: 12 layers, 9 gated delta rule layers (4 key heads for 8 value heads of 128) and 3
gated full-attention layers (8 heads over 2 KV heads of 128, a quarter rotary), hidden 1024,
MoE of 8 experts of 512 (top 2) with a 512 shared expert, tied embeddings; built once under
$BATCHRUN_CACHE/bench-models/qwen3_next. The backend (`transformers`) runs Qwen3-Next only once
its gated delta mixer lands (models/transformers/); until then it is reported as refused and
the table compares native with the static batches. Decode cost: one sequence with a prompt of
each length, the median of its 16 decode steps (the engine stepped by hand): the linear layers'
state is the same size at any length, so only the 3 attention layers' share grows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench import load_workload, report, run_batchrun, run_hf_static  # noqa: E402
from benchmarks.workloads import workload_path  # noqa: E402

SHAPE = dict(
    hidden_size=1024, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-6,
    initializer_range=0.02, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, tie_word_embeddings=True,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3)


def build_checkpoint():
    """The random-weight checkpoint (built on first use) with SmolLM2's tokenizer."""
    import transformers

    from batchrun.models.weights.resolve import resolve_model
    from batchrun.paths import cache_dir

    path = cache_dir() / "bench-models" / "qwen3_next"
    if (path / "model.safetensors").exists():
        return path
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)
    cfg = transformers.Qwen3NextConfig(vocab_size=len(tokenizer), **SHAPE)
    cfg.bos_token_id, cfg.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    cfg.pad_token_id = tokenizer.pad_token_id or 0
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load(system: str, path, threads: int | None = None):
    from transformers import AutoModelForCausalLM

    from batchrun import llm
    from batchrun.options.engine import EngineConfig

    if system == "hf-static":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return llm.load(str(path), EngineConfig.default(
        model_impl=system, **({"threads": threads} if threads else {})))


def throughput(path, systems: list[str], limit: int, max_tokens: int,
               threads: int | None) -> None:
    loaded, results = {}, []
    for system in systems:
        try:
            loaded[system] = load(system, path, threads)
        except Exception as exc:  # the backend before its Qwen3-Next mixer lands
            print(f"{system}: not run ({type(exc).__name__}: {str(exc)[:160]})")
    engine_system = next(s for s in loaded if s != "hf-static")
    tokenizer = loaded[engine_system].tokenizer
    work = load_workload(workload_path("humaneval_chat.jsonl"), tokenizer, limit)
    work.max_tokens = [min(m, max_tokens) for m in work.max_tokens]
    for system, model in loaded.items():
        start = time.process_time()
        if system == "hf-static":
            result = run_hf_static(model, work, tokenizer.eos_token_id, ignore_eos=True)
        else:
            result = run_batchrun(model, work, system, ignore_eos=True)
        result.system = system
        results.append(result)
        print(f"  {system}: {result.output_tps:.1f} output tok/s, "
              f"{time.process_time() - start:.1f} CPU s", file=sys.stderr)
    print(f"{len(work.prompts)} requests, {sum(map(len, work.prompts))} prompt tokens, "
          f"max_tokens {max(work.max_tokens)} (forced)")
    print(report(results, baseline=results[-1].system))


def decode_cost(path, contexts: list[int], threads: int | None, steps: int = 16) -> None:
    """Milliseconds per decode step of one sequence after a prompt of each length: the engine
    stepped by hand, the steps after the prompt's last chunk timed alone (a long prompt's
    prefill time varies by more than the decode steps take)."""
    import statistics

    from batchrun.engine import SamplingParams

    engine = load("native", path, threads).engine
    gen = torch.Generator().manual_seed(0)
    print(f"{'context':>8}{'ms / decode step (median)':>28}")
    for n in contexts:
        prompt = torch.randint(3, 40000, (n,), generator=gen).tolist()
        engine.add_request(f"ctx{n}", prompt, SamplingParams(
            temperature=0, max_tokens=steps + 1, ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        decodes = times[-steps:]  # the last `steps` steps are decodes (one token each)
        print(f"{n:>8}{statistics.median(decodes) * 1e3:>28.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="first N HumanEval requests")
    ap.add_argument("--max-tokens", type=int, default=32, help="each request's (forced) length")
    ap.add_argument("--systems", default="native,transformers,hf-static")
    ap.add_argument("--contexts", default="64,512,2048", help="decode cost at these prompt "
                    "lengths (empty: skip)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (and hf-static's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    path = build_checkpoint()
    from benchmarks.native_vs_backend import parameter_count

    print(f"Qwen3-Next-shaped, {parameter_count(path) / 1e6:.0f}M parameters")
    if args.systems:
        throughput(path, args.systems.split(","), args.limit, args.max_tokens, args.threads)
    if args.contexts:
        decode_cost(path, [int(c) for c in args.contexts.split(",")], args.threads)
    print(f"torch threads {torch.get_num_threads()}")


def cpu_line() -> str:
    """The CPU model and its vector flags (the kernels' paths: AVX-512, AVX2+FMA, portable)."""
    model, flags = "unknown CPU", set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and model == "unknown CPU":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")
    return (f"CPU: {model}, {os.cpu_count()} cores; flags: "
            f"{' '.join(f for f in wanted if f in flags) or 'none of ' + ', '.join(wanted)}")


if __name__ == "__main__":
    main()
