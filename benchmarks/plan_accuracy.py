"""How close `batchrun plan` comes to `batchrun run`: wall time and prefix-cache hit rate.

    python benchmarks/plan_accuracy.py                       # HumanEval chat + few-shot
    python benchmarks/plan_accuracy.py my.jsonl --limit 64

For each workload, in a fresh runs folder (no earlier run calibrates anything):
  1. `batchrun plan W --calibration benchmark --json`: the estimate from the micro-benchmark;
  2. `batchrun plan W --calibration last-run --json`: calibrated by the run of the *previous*
     workload (the first workload has none: skipped);
  3. `batchrun run W`: the measured wall time (the metrics' wall_time_s: the run, without
     loading the model) and cache hit rate. This run calibrates the next workload's step 2.
Everything goes through the CLI, as a user would see it. Figures depend on the machine and its
load: name the CPU next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import BUILDERS, workload_path  # noqa: E402


def batchrun(*args: str, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "batchrun", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"batchrun {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc


def cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "?")
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{name}, {os.cpu_count()} cores, {isa}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", help="batch files [default: the HumanEval chat and "
                    "few-shot workloads of benchmarks/workloads.py]")
    ap.add_argument("--limit", type=int, help="only the first N lines of each")
    ap.add_argument("options", nargs=argparse.REMAINDER, help="after --: run/plan options")
    args = ap.parse_args()
    extra = [a for a in args.options if a != "--"]
    workloads = [Path(w) for w in args.workloads] or [Path(workload_path(n)) for n in BUILDERS]
    tmp = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    env = dict(os.environ, BATCHRUN_RUNS_DIR=str(tmp / "runs"))
    rows = []
    for n, workload in enumerate(workloads):
        src = workload
        if args.limit:
            src = tmp / workload.name
            with open(workload) as f:
                src.write_text("".join(line for _, line in zip(range(args.limit), f)))
        bench = json.loads(batchrun("plan", str(src), "--calibration", "benchmark", "--json",
                                    *extra, env=env).stdout)
        last = None
        if n > 0:
            last = json.loads(batchrun("plan", str(src), "--calibration", "last-run", "--json",
                                       *extra, env=env).stdout)
        out = tmp / f"{n}.jsonl"
        batchrun("run", str(src), "-o", str(out), "-q", *extra, env=env)
        measured = json.loads((tmp / f"{n}.metrics.json").read_text())
        rows.append((workload.name, bench["lines"], bench["cache_hit_rate"],
                     measured["cache_hit_rate"], bench["estimated_seconds"],
                     last["estimated_seconds"] if last else None, measured["wall_time_s"],
                     measured["completion_tokens"], bench["requested_completion_tokens"]))
    print(f"CPU: {cpu()}")
    print("| workload | lines | cache hit est. / measured | wall est. (micro-benchmark) | "
          "wall est. (last run of the previous workload) | wall measured | completion tokens "
          "generated / requested |")
    print("|---|---|---|---|---|---|---|")
    for name, lines, hit_e, hit_m, est_b, est_l, wall, gen, req in rows:
        last = f"{est_l:.1f} s ({est_l / wall - 1:+.0%})" if est_l is not None else "–"
        print(f"| {name} | {lines} | {hit_e:.1%} / {hit_m:.1%} | {est_b:.1f} s "
              f"({est_b / wall - 1:+.0%}) | {last} | {wall:.1f} s | {gen:,} / {req:,} |")


if __name__ == "__main__":
    main()
