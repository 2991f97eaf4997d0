"""MoE step time against the number of experts: the native path (models/arch/moe.py, or
models/arch/gpt_oss.py with --family gpt_oss) beside the transformers backend on the same random-weight
Qwen3-MoE (or GPT-OSS) checkpoint.

Each row is one checkpoint: EXPERTS experts of the same size, top-k fixed, so every token runs the
same active parameters whatever the expert count. Columns: engine step wall time (median) of a
decode step of 1 sequence (k experts active per layer), a decode step of 32 sequences (up to
32*k experts active per layer: the expert weights a step reads grow with how many are hit), and a
prefill of one 256-token prompt; native and transformers side by side, their ratio, and the mean
number of distinct experts the 32-sequence step hit per layer. Both engines are loaded at once
and take turns; each figure is the best of --rounds rounds (the least disturbed by other work on
a shared machine).

    python benchmarks/moe.py [--experts 8 32 128] [--top-k 2] [--layers 4] [--hidden 512]
        [--expert-size 256] [--steps 4] [--rounds 3] [--threads 1] [--dtype float32]
        [--family qwen3_moe|gpt_oss]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from batchrun.engine import SamplingParams  # noqa: E402
from batchrun.llm import build_engine, load_weights  # noqa: E402
from batchrun.options.engine import EngineConfig  # noqa: E402
from benchmarks.bench import machine_line  # noqa: E402

CPU = torch.device("cpu")
DECODE_WIDE, PROMPT, PREFILL = 32, 16, 256


class _Tokens:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return ""


def make_checkpoint(path: Path, experts: int, args) -> int:
    """A random Qwen3-MoE (or GPT-OSS: sliding 128-token windows on every other layer, sinks)
    checkpoint in `path`; returns its parameter count."""
    import transformers

    shape = dict(vocab_size=8192, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                 num_experts_per_tok=args.top_k, max_position_embeddings=1024)
    if args.family == "gpt_oss":
        cfg = transformers.GptOssConfig(**shape, intermediate_size=args.expert_size,
                                        num_local_experts=experts,
                                        architectures=["GptOssForCausalLM"])
        model_class = transformers.GptOssForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**shape, intermediate_size=4 * args.hidden,
                                          moe_intermediate_size=args.expert_size,
                                          num_experts=experts, norm_topk_prob=True,
                                          architectures=["Qwen3MoeForCausalLM"])
        model_class = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = model_class(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def engine_for(path: Path, impl: str, dtype: torch.dtype):
    config = EngineConfig.default(model_impl=impl, max_num_batched_tokens=512, max_num_seqs=64)
    return build_engine(load_weights(path, config, CPU, dtype), _Tokens(), config, [2], CPU, dtype)


def step_times(engine, prompts: list[list[int]], steps: int, skip: int) -> list[float]:
    """Wall time of engine steps `skip`.. `skip + steps` of greedy runs of `prompts`."""
    params = SamplingParams(temperature=0, max_tokens=skip + steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[skip:skip + steps]


def hit_experts(engine, prompts) -> float:
    """Mean distinct experts per MoE layer in a decode step of `prompts` (native engine)."""
    seen: list[int] = []
    hooks = [m.gate.register_forward_hook(lambda mod, inp, out, k=m.top_k: seen.append(
        int(out.topk(k, dim=-1).indices.unique().numel())))
        for m in engine.runner.model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    step_times(engine, prompts, 1, 1)
    for hook in hooks:
        hook.remove()
    return statistics.mean(seen[-len(hooks):])


def measure(path: Path, dtype, rounds: int, steps: int) -> dict[str, dict]:
    """impl -> kind -> best step time over `rounds` rounds, the two engines taking turns (on a
    shared machine the best of several is the figure least bent by other processes)."""
    gen = torch.Generator().manual_seed(0)
    wide = [torch.randint(3, 8192, (PROMPT,), generator=gen).tolist() for _ in range(DECODE_WIDE)]
    long_prompt = [torch.randint(3, 8192, (PREFILL,), generator=gen).tolist()]
    engines = {impl: engine_for(path, impl, dtype) for impl in ("native", "transformers")}
    best: dict[str, dict] = {impl: {} for impl in engines}
    for _ in range(rounds):
        for impl, engine in engines.items():
            times = {"decode-1": step_times(engine, wide[:1], steps, 1),
                     f"decode-{DECODE_WIDE}": step_times(engine, wide, steps, 1),
                     f"prefill-{PREFILL}": step_times(engine, long_prompt, 1, 0)}
            for kind, ts in times.items():
                best[impl][kind] = min(ts + [best[impl].get(kind, float("inf"))])
    best["native"]["hit"] = hit_experts(engines["native"], wide)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "gpt_oss"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; "
          f"{args.family}, {args.layers} layers, hidden {args.hidden}, expert size {args.expert_size}, "
          f"top-{args.top_k}; engine step wall time, best of {args.rounds} rounds, ms "
          f"(native / transformers = speed-up)")
    kinds = ["decode-1", f"decode-{DECODE_WIDE}", f"prefill-{PREFILL}"]
    print(f"{'experts':>7} {'params':>8} " + " ".join(f"{k:>26}" for k in kinds)
          + f" {'experts hit/layer':>18}")
    for experts in args.experts:
        with tempfile.TemporaryDirectory() as tmp:
            params = make_checkpoint(Path(tmp), experts, args)
            times = measure(Path(tmp), dtype, args.rounds, args.steps)
        native, backend = times["native"], times["transformers"]
        cells = [f"{native[k] * 1e3:7.1f} / {backend[k] * 1e3:7.1f} = {backend[k] / native[k]:4.2f}x"
                 for k in kinds]
        print(f"{experts:>7} {params / 1e6:>7.0f}M " + " ".join(f"{c:>26}" for c in cells)
              + f" {native['hit']:>18.1f}", flush=True)


if __name__ == "__main__":
    main()
