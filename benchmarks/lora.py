"""LoRA on the bundled model: 4 adapters served side by side in one engine against the base alone
and against 4 merged models loaded one after another.

    python benchmarks/lora.py --limit 32 --max-tokens 32

1. Kernels: the low-rank update of one fused projection (SmolLM2's qkv, 576 -> 960, rank 16, 4
   adapters in the step) computed segmented by adapter (what batchrun does: two small GEMMs per
   run of rows) and gathered per row (A and B gathered for each row, a batched matmul).
2. End to end, greedy chat requests built from HumanEval's prompts (the benchmark workload):
   the same requests on the base model, then spread round-robin over 4 adapters (rank 16, every
   projection) on the same engine, then each adapter's quarter on its own merged model
   (peft merge_and_unload, saved and loaded by batchrun), load time included.
Prints the CPU (model, AVX-512 / AVX2) next to the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.scoring import cpu_name  # noqa: E402
from benchmarks.workloads import INSTRUCTION, humaneval_problems  # noqa: E402

RANK = 16


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def kernels(rows: int, adapters: int = 4, fan_in: int = 576, fan_out: int = 960) -> tuple[float, float, float]:
    """(base GEMM, segmented update, gathered update) in ms for `rows` rows over `adapters`."""
    from batchrun.models.layers import packed_linear

    torch.manual_seed(0)
    x = torch.randn(rows, fan_in)
    base = packed_linear.PackedLinear(torch.randn(fan_out, fan_in), None) \
        if packed_linear.available(torch.float32) else torch.nn.Linear(fan_in, fan_out, bias=False)
    a_t = torch.randn(adapters, fan_in, RANK) * 0.05
    b_t = torch.randn(adapters, RANK, fan_out) * 0.05
    slot = torch.arange(rows) * adapters // rows  # contiguous runs, as the runner orders them
    bounds = [(int((slot < s).sum()), int((slot <= s).sum()), s) for s in range(adapters)]

    def segmented():
        y = base(x)
        for start, end, s in bounds:
            y[start:end].addmm_(x[start:end] @ a_t[s], b_t[s])
        return y

    def gathered():
        y = base(x)
        shrunk = torch.bmm(x[:, None, :], a_t[slot])  # [rows, 1, r]
        return y + torch.bmm(shrunk, b_t[slot])[:, 0]

    assert torch.allclose(segmented(), gathered(), atol=1e-3)
    return _best(lambda: base(x)), _best(segmented), _best(gathered)


def requests(tokenizer, limit: int) -> list[list[int]]:
    problems = humaneval_problems()[:limit]
    out = []
    for _, prompt in problems:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{INSTRUCTION}\n\n{prompt}"}],
            add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def timed(engine, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=32, help="requests (HumanEval problems)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kernels-only", action="store_true")
    ap.add_argument("--skip-merged", action="store_true", help="leave out the merged models")
    ap.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                    help="the path the base runs on (LoRA on the transformers backend: transformers)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: all]")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["BATCHRUN_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"\nLoRA update of a fused qkv projection (576 -> 960, rank {RANK}, 4 adapters), ms:")
    print(f"{'rows':>6} {'base GEMM':>10} {'+segmented':>11} {'+gathered':>10}")
    for rows in (16, 64, 256, 1024):
        base, seg, gat = kernels(rows)
        print(f"{rows:>6} {base:>10.3f} {seg:>11.3f} {gat:>10.3f}")
    if args.kernels_only:
        return 0

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from batchrun import llm
    from batchrun.engine import SamplingParams
    from batchrun.models.weights.resolve import resolve_model
    from batchrun.options.engine import EngineConfig

    base_path = resolve_model(None).path
    tmp = Path(tempfile.mkdtemp(prefix="batchrun-lora-bench-"))
    hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    names = [f"tune{i}" for i in range(4)]
    paths = {}
    for i, name in enumerate(names):
        torch.manual_seed(i)  # init_lora_weights=False: a random lora_B, not the no-op zeros
        tuned = get_peft_model(copy.deepcopy(hf), LoraConfig(
            r=RANK, lora_alpha=16, target_modules=targets, init_lora_weights=False))
        tuned.save_pretrained(tmp / name)
        paths[name] = str(tmp / name)
    del hf, tuned

    loaded = llm.load(None, EngineConfig.default(lora=paths, max_loras=4, max_lora_rank=RANK,
                                                 model_impl=args.model_impl))
    prompts = requests(loaded.tokenizer, args.limit)
    greedy = lambda lora=None: SamplingParams(temperature=0, max_tokens=args.max_tokens,  # noqa
                                              ignore_eos=True, lora=lora)
    timed(loaded.engine, prompts[:2], greedy())  # warm up (kernels, packed weights)
    loaded.engine.kv.reset_prefix_cache()
    base_s, base_tokens = timed(loaded.engine, prompts, greedy())
    loaded.engine.kv.reset_prefix_cache()
    lora_s, lora_tokens = timed(loaded.engine, prompts,
                                [greedy(names[i % 4]) for i in range(len(prompts))])
    print(f"\n{len(prompts)} chat requests, {args.max_tokens} greedy tokens each "
          f"(--model-impl {args.model_impl}):")
    print(f"  base model alone          {base_s:7.2f} s  {base_tokens / base_s:6.1f} tok/s")
    print(f"  4 adapters, one engine    {lora_s:7.2f} s  {lora_tokens / lora_s:6.1f} tok/s  "
          f"({lora_s / base_s:.2f}x the base)")
    del loaded
    if args.skip_merged:
        return 0
    total = run_only = 0.0
    for i, name in enumerate(names):
        merged_dir = tmp / f"merged-{name}"
        _save_merged(base_path, paths[name], merged_dir)
        llm_start = time.perf_counter()
        one = llm.load_from_path(merged_dir, EngineConfig.default())
        load_s = time.perf_counter() - llm_start
        mine = prompts[i::4]
        run_s, _ = timed(one.engine, mine, greedy())
        total += load_s + run_s
        run_only += run_s
        del one
    print(f"  4 merged models in turn   {total:7.2f} s  (loads included; {run_only:.2f} s "
          f"generating) ({total / lora_s:.2f}x the adapters in one engine)")
    return 0


def _save_merged(base_path, adapter: str, out: Path) -> None:
    """The base with the adapter merged in (peft merge_and_unload), its tokenizer beside it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    PeftModel.from_pretrained(hf, adapter).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(out)


if __name__ == "__main__":
    sys.exit(main())
