"""The GPU benchmark (issue 39, item 7), one run, one JSON: on random-weight checkpoints shaped
like Llama-3.2-1B and a 4-layer Qwen3-30B-A3B (benchmarks/gpu_shapes.py), in bf16 and with
--quantization fp8, batchrun's output tok/s on the HumanEval chat workload x8 and the few-shot
shared-prefix workload, against transformers' continuous batching (generate_batch) and its static
batches of 32 on the same GPU; and the decode step's achieved HBM bandwidth and the prefill's
achieved TFLOP/s as fractions of the GPU's peaks (benchmarks/gpu_roofline.py).

    python benchmarks/gpu_bench.py --json bench.json [--budget 300]
    python benchmarks/gpu_bench.py --dry-run --json bench.json    # tiny shapes on the CPU

Every request runs to its max_tokens. transformers' baselines run on part of each workload (the
continuous batching on its first --hf-requests, the static batches for --hf-static-s seconds):
their rates stand for the whole. Each measurement is written to the JSON as soon as it ends, a
failed one as {"error": ...} without stopping the others; one that would start with under 15 s
of --budget left is {"skipped": "budget"}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICE_DIR = ROOT / ".device"  # what benchmarks/prepare_device_run.sh builds
SHARED_CHAT = Path("/work/shared/workloads/humaneval_chat.jsonl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


class Run:
    """The report being built, written out after every measurement, and the time left."""

    def __init__(self, path: str | None, budget_s: float):
        self.path, self.deadline = path, time.monotonic() + budget_s
        self.report: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            Path(tmp).write_text(json.dumps(self.report, indent=2) + "\n")
            os.replace(tmp, self.path)

    def measure(self, where: dict, key: str, fn: Callable[[], dict]) -> dict | None:
        if self.left() < 15:
            where[key] = {"skipped": "budget"}
            self.write()
            return None
        start = time.perf_counter()
        try:
            where[key] = fn()
        except Exception as exc:  # one failed measurement must not hide the others
            traceback.print_exc()
            where[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        where[key]["wall_s"] = round(time.perf_counter() - start, 2)
        print(f"{key}: {json.dumps(where[key])}", flush=True)
        self.write()
        return where[key] if "error" not in where[key] else None


def tokenizer_dir() -> Path:
    """The bundled model's tokenizer: .device/tokenizer, else the converted model's folder."""
    if (DEVICE_DIR / "tokenizer" / "tokenizer.json").is_file():
        return DEVICE_DIR / "tokenizer"
    from batchrun.models.weights.resolve import resolve_model

    return Path(resolve_model(None).path)


def chat_path() -> str:
    for path in (DEVICE_DIR / "workloads" / "humaneval_chat.jsonl", SHARED_CHAT):
        if path.is_file():
            return str(path)
    from benchmarks.workloads import workload_path

    return workload_path("humaneval_chat.jsonl")


def workloads(tokenizer, dry_run: bool) -> dict:
    """name -> Workload: the HumanEval chat batch x8 and the few-shot sweep (20 prefixes x 8)."""
    from benchmarks.bench import Workload, fewshot_workload, load_workload

    path = chat_path()
    chat = load_workload(path, tokenizer, 4 if dry_run else None)
    fewshot = fewshot_workload(path, tokenizer, 4 if dry_run else None, 2 if dry_run else 20)
    copies = 2 if dry_run else 8
    out = {"chat_x8": Workload(f"humaneval_chat x{copies}", chat.prompts * copies,
                               chat.max_tokens * copies), "fewshot": fewshot}
    if dry_run:
        for work in out.values():
            work.max_tokens = [4] * len(work.prompts)
    return out


def load_engine(path: Path, device: torch.device, quantization: str, dry_run: bool):
    from batchrun.llm import load_from_path
    from batchrun.options.engine import EngineConfig

    config = EngineConfig.default(
        device=device.type, dtype="float32" if dry_run else "bfloat16", quantization=quantization,
        max_num_seqs=8 if dry_run else 256, kv_cache_memory=(64 << 20) if dry_run else (24 << 30),
        max_num_batched_tokens=64 if dry_run else 2048, threads=1 if dry_run else None)
    return load_from_path(path, config)


def free(*objects) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_model(run: Run, name: str, device: torch.device, dry_run: bool, args) -> None:
    from benchmarks import gpu_roofline as roofline, gpu_shapes

    out: dict[str, Any] = run.report["models"].setdefault(name, {})
    dtype = torch.float32 if dry_run else torch.bfloat16
    folder = Path(tempfile.mkdtemp(prefix=f"gpu_bench_{name}_"))
    baselines = name == "llama-1b"  # transformers' MoE experts loop in Python: too slow to time
    try:
        start = time.perf_counter()
        hf = gpu_shapes.make_checkpoint(name, folder, device, dtype, tiny=dry_run)
        for file in TOKENIZER_FILES:
            if (tokenizer_dir() / file).is_file():
                shutil.copy(tokenizer_dir() / file, folder / file)
        cfg = hf.config
        out["config"] = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                         "params_b": sum(p.numel() for p in hf.parameters()) / 1e9,
                         "active_linear_params_b": roofline.linear_params_per_token(cfg) / 1e9,
                         "build_s": round(time.perf_counter() - start, 1)}
        if not baselines:
            hf = None
            free()
        from batchrun.models.text.tokenizer import load_tokenizer

        work = workloads(load_tokenizer(folder), dry_run)
        for quantization in ("none", "fp8"):
            label = ("float32" if dry_run else "bf16") if quantization == "none" else "fp8"
            loaded: Any = None

            def load(q=quantization):
                nonlocal loaded
                t = time.perf_counter()
                loaded = load_engine(folder, device, q, dry_run)
                return {"load_s": round(time.perf_counter() - t, 1)}

            if run.measure(out, f"load_{label}", load) is not None:
                engine_figures(run, out, loaded.engine, cfg, label, work, device, dtype, dry_run)
            loaded = None
            free()
            if hf is not None:  # after bf16, before fp8: the comparisons the targets name first
                transformers_baselines(run, out, hf, work, device, dry_run, args)
                hf = None
                free()
    finally:
        hf = None
        free()
        shutil.rmtree(folder, ignore_errors=True)
    ratios(out)
    run.write()


def engine_figures(run: Run, out: dict, engine, cfg, label: str, work: dict,
                   device: torch.device, dtype: torch.dtype, dry_run: bool) -> None:
    """Throughput on each workload, then the decode step at 256 sequences of 512-token
    contexts and the prefill of 2k-token prompts against the GPU's peaks."""
    from benchmarks import gpu_roofline as roofline, gpu_systems as systems

    for wname, w in work.items():
        run.measure(out.setdefault(wname, {}), f"batchrun_{label}",
                    lambda w=w: systems.run_batchrun(engine, w, device))
    peak = run.report.get("peaks")
    vocab = min(cfg.vocab_size, 49152)
    run.measure(out, f"decode_{label}", lambda: roofline.measure_decode(
        engine, cfg, device, dtype, 4 if dry_run else 256, 32 if dry_run else 512,
        4 if dry_run else 16, peak, vocab))
    run.measure(out, f"prefill_{label}", lambda: roofline.measure_prefill(
        engine, cfg, device, 2 if dry_run else 16, 48 if dry_run else 2048, peak, vocab,
        "fp8_tflop_s" if label == "fp8" else "bf16_tflop_s"))


def transformers_baselines(run: Run, out: dict, hf, work: dict, device: torch.device,
                           dry_run: bool, args) -> None:
    from benchmarks import gpu_systems as systems

    for wname, w in work.items():
        where = out.setdefault(wname, {})
        run.measure(where, "hf_continuous", lambda w=w: systems.run_hf_continuous(
            hf, w, device, 2 if dry_run else args.hf_requests, 8 if dry_run else None))
        run.measure(where, "hf_static_32", lambda w=w: systems.run_hf_static(
            hf, w, device, 0.0 if dry_run else args.hf_static_s))


def ratios(out: dict) -> None:
    """Each batchrun figure over each transformers baseline measured on the same workload."""
    for wname in ("chat_x8", "fewshot"):
        where = out.get(wname, {})
        for ours in [k for k in where if k.startswith("batchrun_")]:
            for base in ("hf_continuous", "hf_static_32"):
                a, b = where[ours].get("out_tok_s"), where.get(base, {}).get("out_tok_s")
                if a and b:
                    where.setdefault("ratios", {})[f"{ours}/{base}"] = round(a / b, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the report here (after every measurement)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes and workloads on the CPU: the plumbing, in seconds")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for everything [300]")
    ap.add_argument("--models", default="llama-1b,qwen3-30b-a3b-4l")
    ap.add_argument("--hf-requests", type=int, default=256,
                    help="requests of each workload transformers' continuous batching runs [256]")
    ap.add_argument("--hf-static-s", type=float, default=20.0,
                    help="seconds of static batches per workload [20]")
    args = ap.parse_args(argv)
    from benchmarks import gpu_roofline

    if args.dry_run:
        device = torch.device("cpu")
        name = "cpu (dry run)"
    elif not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on the CPU")
        return 2
    else:
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
    run = Run(args.json, args.budget)
    key, peak = gpu_roofline.peaks_for(name)
    run.report.update({"device": name, "peak_row": key, "peaks": peak, "models": {},
                       "torch": torch.__version__})
    import transformers

    run.report["transformers"] = transformers.__version__
    run.write()
    for model in args.models.split(","):
        try:
            bench_model(run, model, device, args.dry_run, args)
        except Exception as exc:
            traceback.print_exc()
            run.report["models"].setdefault(model, {})["error"] = f"{type(exc).__name__}: {exc}"
            run.write()
    errors = [f"{m}.{k}" for m, r in run.report["models"].items() for k, v in _leaves(r)
              if k == "error"]
    run.report["errors"] = errors
    run.write()
    return 1 if errors else 0


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield k, v


if __name__ == "__main__":
    sys.exit(main())
