"""Peak memory of the batch I/O pipeline against input size: is it flat?

    python benchmarks/memory_bench.py                                 # validate 10^4..10^6
    python benchmarks/memory_bench.py --run-sizes 1000 10000          # + real max_tokens=1 runs
    python benchmarks/memory_bench.py --fake-run-sizes 10000 100000   # + runs on a fake engine
    python benchmarks/memory_bench.py --sizes --plan-sizes 10000 100000 # `batchrun plan`

Run it from anywhere; the fake-engine runs go through `python -m tests.fake_batchrun` (the
batchrun CLI with the test suite's fake engine loader) with the repository root on PYTHONPATH.

Each measurement is a fresh `batchrun` process; its peak RSS comes from wait4() (the kernel's
own maximum, nothing sampled). Inputs are generated: chat requests of varied length with unique
custom_ids, plus 1% malformed lines and 0.5% duplicate custom_ids, so the error path and the
duplicate set are exercised too. `validate` measures the reader, the validation and the
custom_id set; `run` adds the engine, staging commits and the final merge. What may grow with
the input is the custom_id set (16-byte digests, about 20 bytes a line) and, when resuming, one
state byte per line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def make_input(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            roll = rng.random()
            if roll < 0.01:
                f.write('{"custom_id": "broken-%d", "body": \n' % i)
                continue
            cid = f"req-{rng.randrange(i)}" if roll < 0.015 and i else f"req-{i}"
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
            body = {"messages": [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": f"Summarise: {words}"}],
                    "max_tokens": 1, "temperature": 0}
            f.write(json.dumps({"custom_id": cid, "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, float, int]:
    """(peak RSS in MiB, wall seconds, exit code) of one process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode not in (0, 3):  # 3: the planted bad lines
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {err[-2000:]}")
    return usage.ru_maxrss / 1024, wall, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--run-sizes", type=int, nargs="*", default=[],
                        help="line counts for runs on the real bundled model (max_tokens 1)")
    parser.add_argument("--fake-run-sizes", type=int, nargs="*", default=[],
                        help="line counts for runs on the test suite's fake engine")
    parser.add_argument("--plan-sizes", type=int, nargs="*", default=[],
                        help="line counts for `batchrun plan` (tokenizer, no weights; its "
                        "time estimate calibrated by the micro-benchmark)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--workdir", help="keep inputs here [default: a temporary folder]")
    args = parser.parse_args()

    root = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "batchrun"]
    fake = [sys.executable, "-m", "tests.fake_batchrun"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)

        def input_of(n: int) -> Path:
            path = work / f"in-{n}.jsonl"
            if not path.exists():
                make_input(path, n)
            return path

        plans = [("validate", n, base + ["validate", "-q", str(input_of(n))], None)
                 for n in args.sizes]
        for n in args.run_sizes:
            plans.append(("run (real model, max_tokens 1)", n, base + [
                "run", str(input_of(n)), "-o", str(work / f"out-{n}.jsonl"), "-q", "--restart",
                "--kv-cache-memory", args.kv_cache_memory], None))
        path = os.environ.get("PYTHONPATH")
        fake_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + ([path] if path else [])))
        for n in args.fake_run_sizes:
            plans.append(("run (fake engine)", n, fake + [
                "run", str(input_of(n)), "-o", str(work / f"fake-{n}.jsonl"), "-q",
                "--restart"], fake_env))
        for n in args.plan_sizes:
            plans.append(("plan", n, base + ["plan", str(input_of(n)), "--calibration",
                                             "benchmark", "--json"], None))
        for what, n, cmd, env in plans:
            rss, wall, _ = measure(cmd, env)
            rows.append({"what": what, "lines": n, "peak_rss_mib": round(rss, 1),
                         "seconds": round(wall, 1), "lines_per_s": round(n / wall)})
            print(f"{what:32s} {n:>9,d} lines  peak RSS {rss:7.1f} MiB  {wall:7.1f} s  "
                  f"({n / wall:,.0f} lines/s)", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
