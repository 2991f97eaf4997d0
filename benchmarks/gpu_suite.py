"""The GPU suite: every kernel check in benchmarks/kernel_checks/ (each module's CHECKS, found with
pkgutil), on a GPU, or with --interpret on the CPU under Triton's interpreter.

    python benchmarks/gpu_suite.py --interpret --json kernels.json [--only prefill,decode]
    python benchmarks/gpu_suite.py --json gpu.json            # on a CUDA machine, under 8 min
    python benchmarks/gpu_suite.py --dry-run --json dry.json  # the stages' plumbing on the CPU

Writes {"kernels": {name: {"pass": bool, "max_err": float}}} (a check that raised has max_err
null and its error); exits 1 when any check fails. On CUDA the stages of GPU_STAGES run after the
kernel checks, each in a time-boxed subprocess adding its own key to the same JSON
(benchmarks/gpu_stages.py: "cuda_tests", "benchmark"); a failed stage is named in "failed" and
the others still run. --dry-run runs those stages on the CPU at tiny sizes, without the kernel
checks (--interpret runs those).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_stages import STAGES, StageOptions  # noqa: E402


def discover_checks() -> dict[str, Callable[[Any], tuple[float, float]]]:
    """Every module's CHECKS in benchmarks/kernel_checks, by kernel name (names are unique)."""
    import benchmarks.kernel_checks as package

    found: dict[str, Callable[[Any], tuple[float, float]]] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, check in getattr(module, "CHECKS", {}).items():
            if name in found:
                raise ValueError(f"kernel check {name!r} defined twice ({info.name})")
            found[name] = check
    return found


def run_checks(device, only: set[str] | None) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, check in discover_checks().items():
        if only is not None and name not in only:
            continue
        start = time.perf_counter()
        try:
            err, tol = check(device)
            results[name] = {"pass": bool(err <= tol), "max_err": float(err), "tol": float(tol)}
        except Exception as exc:  # one broken kernel must not hide the others' results
            traceback.print_exc()
            results[name] = {"pass": False, "max_err": None,
                             "error": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 3)
        print(f"{name:24s} {'ok' if results[name]['pass'] else 'FAIL'} "
              f"max_err={results[name]['max_err']}", flush=True)
    return results


# The suite's later parts on a GPU (issue 39, item 7): each stage takes the report so far, adds
# its key and returns whether it passed. They run only without --interpret and --only.
GPU_STAGES: list[tuple[str, Callable[[dict[str, Any], StageOptions], bool]]] = STAGES


def run_stages(report: dict[str, Any], options: StageOptions) -> None:
    for name, stage in GPU_STAGES:
        try:
            passed = stage(report, options)
        except Exception as exc:  # a broken stage must not hide the others
            traceback.print_exc()
            report[name] = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
            passed = False
        if not passed:
            report.setdefault("failed", []).append(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true",
                    help="run the Triton kernels under Triton's interpreter on the CPU")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="comma-separated kernel names to run (default: all); "
                    "with it no GPU stage runs")
    ap.add_argument("--dry-run", action="store_true",
                    help="the CUDA tests and benchmark stages on the CPU at tiny sizes (no kernel checks)")
    ap.add_argument("--minutes", type=float, default=7.5,
                    help="the whole suite's time: the stages' boxes end by then [7.5]")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + 60 * args.minutes
    if args.dry_run:
        report: dict[str, Any] = {"device": "cpu (dry run)", "kernels": {}}
        run_stages(report, StageOptions(dry_run=True, deadline=deadline))
        return finish(report, args.json)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # triton.jit reads it when a kernel module loads
    import torch

    device = torch.device("cpu" if args.interpret else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --interpret to check the kernels on the CPU")
        return 2
    only = None if args.only is None else set(args.only.split(","))
    report = {"device": "cpu (Triton interpreter)" if args.interpret
              else torch.cuda.get_device_name(device)}
    start = time.perf_counter()
    report["kernels"] = run_checks(device, only)
    report["kernels_seconds"] = round(time.perf_counter() - start, 1)
    if args.json:  # the kernels' results stand even if a stage takes the process down
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if not args.interpret and only is None:
        run_stages(report, StageOptions(dry_run=False, deadline=deadline))
    return finish(report, args.json)


def finish(report: dict[str, Any], path: str | None) -> int:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    failed = [n for n, r in report["kernels"].items() if not r["pass"]] + report.get("failed", [])
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
