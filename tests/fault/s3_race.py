"""Two `batchrun run` on one S3 output, the second started 0.5-1 s after the first, on a moto
S3 server: exactly one may write it, and the output must hold every record.

    python -m tests.fault.s3_race --trials 20          # from the repository root

Each trial writes a 40-line input to s3://bkt/tN/in.jsonl and starts two CLIs on the fake
engine (python -m tests.fake_batchrun, a few ms per step so that a run lasts ~2 s and the two
overlap) with -o s3://bkt/tN/out.jsonl. A trial is correct when the two did not both exit 0
as writers (a run that took the lease after the other had published finds the output complete
and says "already completed": on a loaded machine the second CLI's start-up can outlast the
first run), neither crashed (exit 1), and out.jsonl holds each of the 40 records once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINES = 40


@dataclass
class RaceResult:
    trial: int
    codes: tuple[int, int] = (0, 0)
    records: int = 0
    sequential: bool = False  # one run found the output already complete and wrote nothing
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _input(rng: random.Random) -> bytes:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"q {i}"}],
                                  "max_tokens": rng.randint(4, 12)}})
             for i in range(LINES)]
    return ("\n".join(lines) + "\n").encode()


def _command(options: dict, key: str) -> list[str]:
    return [sys.executable, "-m", "tests.fake_batchrun", "run", f"s3://bkt/{key}/in.jsonl",
            "-o", f"s3://bkt/{key}/out.jsonl", "--storage-options", json.dumps(options),
            "--max-in-flight", "8", "--commit-interval", "0.05", "--progress", "none"]


def trial(fs, options: dict, index: int, step_s: float = 0.03) -> RaceResult:
    rng = random.Random(index)
    key = f"t{index}"
    fs.pipe(f"bkt/{key}/in.jsonl", _input(rng))
    env = dict(os.environ, BATCHRUN_FAKE_STEP_S=str(step_s),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    first = subprocess.Popen(_command(options, key), cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(rng.uniform(0.5, 1.0))
    second = subprocess.Popen(_command(options, key), cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    errs = [p.communicate(timeout=300)[1] for p in (first, second)]
    result = RaceResult(index, (first.returncode, second.returncode),
                        sequential=any("already completed:" in err for err in errs))
    if first.returncode == second.returncode == 0 and not result.sequential:
        result.problems.append("both runs exited 0 and both wrote")
    for name, code, err in zip(("first", "second"), result.codes, errs):
        if code not in (0, 2):
            result.problems.append(f"the {name} run exited {code}: {err[-1500:]}")
        if "Traceback" in err:
            result.problems.append(f"the {name} run printed a traceback: {err[-1500:]}")
    fs.invalidate_cache()
    try:
        ids = [json.loads(x)["custom_id"] for x in fs.cat(f"bkt/{key}/out.jsonl").splitlines()]
    except FileNotFoundError:
        ids = []
    result.records = len(ids)
    if sorted(ids) != sorted(f"r{i}" for i in range(LINES)):
        result.problems.append(f"out.jsonl holds {len(ids)} records ({len(set(ids))} distinct) "
                               f"for {LINES} input lines")
    return result


def run_trials(fs, options: dict, trials: int, parallel: int = 4) -> list[RaceResult]:
    """Trials on distinct keys, `parallel` at a time."""
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda i: trial(fs, options, i), range(trials)))


def main() -> int:
    from tests.moto_s3 import moto_s3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    with moto_s3() as (fs, options):
        results = run_trials(fs, options, args.trials, args.parallel)
    for r in results:
        status = "ok" if r.ok else "FAILED: " + "; ".join(p.splitlines()[0] for p in r.problems)
        how = " (one run found the output already complete)" if r.sequential else ""
        print(f"trial {r.trial}: exit codes {r.codes}{how}, {r.records} records: {status}")
    correct = sum(r.ok for r in results)
    print(json.dumps({"trials": len(results), "correct": correct}))
    return 0 if correct == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
