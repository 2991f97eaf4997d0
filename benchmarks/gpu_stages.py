"""The GPU suite's stages after the kernel checks (benchmarks/gpu_suite.py): the end-to-end CUDA
tests and the benchmark, each a subprocess with a time box, each adding its key to the report.
A stage returns whether it passed; a stage that raised, timed out or failed is named in
report["failed"] by the suite, and the stages after it still run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
E2E_TESTS = "tests/unit/test_cuda_e2e.py"
OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


@dataclass
class StageOptions:
    dry_run: bool  # on the CPU at tiny sizes: the plumbing only
    deadline: float  # time.monotonic() by which every stage must have ended
    cuda_tests_s: float = 150.0  # the most each stage may take
    benchmark_s: float = 300.0

    def box(self, most: float) -> float:
        return max(10.0, min(most, self.deadline - time.monotonic()))


def run_boxed(cmd: list[str], timeout: float, env: dict[str, str] | None = None):
    """(returncode or None when killed at `timeout`, output, seconds): the command and every
    process it started, in a session of their own, killed at the time box."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    return code, output or "", round(time.perf_counter() - start, 1)


def _outcome(code: int | None, output: str, seconds: float, passed: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"returncode": code, "timed_out": code is None, "seconds": seconds}
    if not passed:
        out["output_tail"] = output[-4000:]
    return out


def cuda_tests(report: dict[str, Any], options: StageOptions) -> bool:
    """tests/unit/test_cuda_e2e.py under pytest: each test's outcome by name (a dry run: its
    native-model test on the CPU)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", E2E_TESTS]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    if options.dry_run:
        cmd += ["-k", "native_model"]
        env["BATCHRUN_E2E_DEVICE"] = "cpu"
    code, output, seconds = run_boxed(cmd, options.box(options.cuda_tests_s), env)
    tests = {m.group(1).split("::", 1)[1]: m.group(2).lower()
             for m in map(OUTCOME.match, output.splitlines()) if m}
    passed = code == 0 and bool(tests) and all(v == "passed" for v in tests.values())
    report["cuda_tests"] = {"pass": passed, "tests": tests, **_outcome(code, output, seconds, passed)}
    print(f"cuda_tests: {'ok' if passed else 'FAIL'} {tests}", flush=True)
    return passed


def benchmark(report: dict[str, Any], options: StageOptions) -> bool:
    """benchmarks/gpu_bench.py with a budget inside the stage's box; what it wrote by the end
    (after every measurement) is kept even when it was killed."""
    box = options.box(options.benchmark_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--json", str(path),
               "--budget", str(max(5.0, box - 30))]
        if options.dry_run:
            cmd.append("--dry-run")
        code, output, seconds = run_boxed(cmd, box, {"PYTHONUNBUFFERED": "1"})
        figures = json.loads(path.read_text()) if path.is_file() else {}
    passed = code == 0
    report["benchmark"] = {**figures, "pass": passed, **_outcome(code, output, seconds, passed)}
    print(f"benchmark: {'ok' if passed else 'FAIL'} in {seconds} s", flush=True)
    return passed


STAGES = [("cuda_tests", cuda_tests), ("benchmark", benchmark)]
