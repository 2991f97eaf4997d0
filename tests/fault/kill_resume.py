"""Kill `batchrun run --resume` with SIGKILL at random points, resume, and check that every
distinct custom_id has exactly one record and every duplicate line exactly one error record.

    python -m tests.fault.kill_resume --trials 100          # from the repository root

Each trial writes an input with valid lines, duplicates of earlier custom_ids and malformed
lines, starts the CLI on the fake engine (python -m tests.fake_batchrun, a few ms per step so that kills
land while requests run, commit, or merge), kills it 1-3 times after a random delay, then
resumes until the run completes and checks the output and error files line by line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.openai_batch_shape import error_of

ROOT = Path(__file__).resolve().parents[2]


def _request(custom_id: str, rng: random.Random) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"question {rng.random():.6f}"}],
                     "max_tokens": rng.randint(1, 8)}}


def make_input(path: Path, n: int, rng: random.Random) -> dict:
    """Write the input; return what the output must hold."""
    lines: list[str] = []
    seen: list[str] = []
    first_line: dict[str, int] = {}  # custom_id -> line number of its first occurrence
    valid_first: set[str] = set()
    error_lines: set[int] = set()
    for i in range(n):
        number = len(lines) + 1
        roll = rng.random()
        if roll < 0.07 and seen:
            cid = rng.choice(seen)
            lines.append(json.dumps(_request(cid, rng)))
            error_lines.add(number)  # a duplicate
        elif roll < 0.10:
            lines.append('{"custom_id": "broken-%d", "method": "POST"' % i)  # bad JSON
            error_lines.add(number)
        elif roll < 0.13:
            cid = f"bad-{i}"
            bad = _request(cid, rng)
            bad["body"]["temperature"] = 9
            lines.append(json.dumps(bad))
            seen.append(cid)
            first_line[cid] = number
            error_lines.add(number)
        else:
            cid = f"id-{i}"
            lines.append(json.dumps(_request(cid, rng)))
            seen.append(cid)
            first_line[cid] = number
            valid_first.add(cid)
        if rng.random() < 0.02:
            lines.append("")  # blank lines are skipped but keep the numbering honest
    path.write_text("\n".join(lines) + "\n")
    return {"valid": valid_first, "error_lines": error_lines,
            "records": sum(1 for line in lines if line.strip())}


@dataclass
class TrialResult:
    seed: int
    kills: int
    attempts: int
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _env(step_s: float) -> dict:
    env = dict(os.environ)
    env.update(BATCHRUN_FAKE_STEP_S=str(step_s),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _command(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "tests.fake_batchrun", "run", str(src), "-o", str(out), "--resume",
            "--max-in-flight", "16", "--commit-interval", "0.05", "--progress", "none"]


def check(out: Path, expected: dict) -> tuple[int, int, list[str]]:
    """(lost, duplicated, problems) of a finished run."""
    problems = []
    results = [json.loads(x) for x in out.read_text().splitlines()]
    errors = [json.loads(x) for x in out.with_name("out.errors.jsonl").read_text().splitlines()]
    ids = [r["custom_id"] for r in results]
    duplicated = len(ids) - len(set(ids))
    lost = len(expected["valid"] - set(ids))
    if set(ids) - expected["valid"]:
        problems.append(f"unexpected results: {sorted(set(ids) - expected['valid'])[:5]}")
    lines = [error_of(e)["line"] for e in errors]
    duplicated += len(lines) - len(set(lines))
    lost += len(expected["error_lines"] - set(lines))
    if set(lines) - expected["error_lines"]:
        problems.append(f"unexpected error lines: {sorted(set(lines) - expected['error_lines'])[:5]}")
    if len(results) + len(errors) != expected["records"]:
        problems.append(f"{len(results)} + {len(errors)} records for {expected['records']} lines")
    if lost:
        problems.append(f"{lost} records lost")
    if duplicated:
        problems.append(f"{duplicated} records duplicated")
    return lost, duplicated, problems


def _committed_positions(staging: Path) -> int:
    """Distinct input lines with a committed record (from the part headers)."""
    positions: set[int] = set()
    for part in staging.glob("part-*.jsonl") if staging.exists() else ():
        with part.open() as f:
            positions.update(json.loads(f.readline())["positions"])
    return len(positions)


def trial(seed: int, workdir: Path, lines: int = 300, step_s: float = 0.006,
          max_kills: int = 2, window: tuple[float, float] = (0.0, 0.6)) -> TrialResult:
    """300 lines at 6 ms a step run for ~0.6 s; most kills come a random 0-0.6 s after the
    attempt's first commit (running, committing, sometimes merging), the rest a random 0-0.6 s
    after the process started (start-up, reading committed parts)."""
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = workdir / "in.jsonl", workdir / "out.jsonl"
    expected = make_input(src, lines, rng)
    env = _env(step_s)
    kills = attempts = 0
    staging = workdir / "out.jsonl.batchrun-staging"
    planned = rng.randint(1, max_kills)
    while attempts < planned or (kills == 0 and attempts < 6):  # at least one kill lands
        before = set(staging.glob("part-*.jsonl")) if staging.exists() else set()
        proc = subprocess.Popen(_command(src, out), cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        attempts += 1
        if rng.random() < 0.8:
            # Mostly mid-run: after this attempt committed its first part (start-up time,
            # which is most of a short run, does not matter then).
            deadline = time.monotonic() + 60
            while (proc.poll() is None and time.monotonic() < deadline and not (
                    staging.exists() and set(staging.glob("part-*.jsonl")) - before)):
                time.sleep(0.005)
        time.sleep(rng.uniform(*window))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
    committed = _committed_positions(workdir / "out.jsonl.batchrun-staging")
    final = subprocess.run(_command(src, out), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    attempts += 1
    result = TrialResult(seed, kills, attempts)
    if final.returncode != 0:
        result.problems.append(f"final run exited {final.returncode}: {final.stderr[-2000:]}")
        return result
    result.lost, result.duplicated, result.problems = check(out, expected)
    if "already completed" in final.stderr:
        # An attempt finished the job (its metrics say so) and was killed while or after
        # removing its staging: the rerun must do nothing but clean up, which the checks of
        # the output and of the staging folder above have verified.
        return result
    metrics = json.loads((workdir / "out.metrics.json").read_text())
    if metrics["resumed"] != committed:
        result.problems.append(f"the final run skipped {metrics['resumed']} lines, but "
                               f"{committed} were committed")
    this_run = metrics["this_run"]["ok"] + metrics["this_run"]["failed"]
    if this_run != expected["records"] - committed:
        result.problems.append(f"the final run redid work: {this_run} lines run, "
                               f"{expected['records'] - committed} were left")
    if (workdir / "out.jsonl.batchrun-staging").exists():
        result.problems.append("the staging folder was left behind")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lines", type=int, default=300)
    args = parser.parse_args()
    totals = {"trials": 0, "kills": 0, "lost": 0, "duplicated": 0, "failed_trials": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            r = trial(args.seed + i, Path(tmp) / f"t{i}", lines=args.lines)
            totals["trials"] += 1
            totals["kills"] += r.kills
            totals["lost"] += r.lost
            totals["duplicated"] += r.duplicated
            totals["failed_trials"] += not r.ok
            status = "ok" if r.ok else "FAILED: " + "; ".join(r.problems)
            print(f"trial {i} seed {r.seed}: {r.kills} kills, {r.attempts} runs: {status}",
                  flush=True)
    print(json.dumps(totals))
    return 0 if totals["failed_trials"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
