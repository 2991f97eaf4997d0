"""The bench's `batchrun-run` system: the whole CLI path users run (a fresh process: imports,
model load, reading the input file, rendering, the engine, committing, merging into the output
file), with the bench's step timers on the engine the CLI builds.

    python -m benchmarks.cli_run TIMINGS.json run IN.jsonl -o OUT.jsonl [run options]

runs `batchrun run ...` and writes the timers' seconds to TIMINGS.json; `run_cli(...)` is what
bench.py calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(lines: list[dict], cli_options: list[str], label: str = "batchrun-run"):
    """Run `lines` (chat batch lines, greedy) through `batchrun run` in a subprocess; a
    bench Result (seconds: the run itself, from its metrics file) plus the process's seconds
    and the timer shares."""
    from benchmarks.bench import Result

    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        src, out, timings = Path(tmp, "in.jsonl"), Path(tmp, "out.jsonl"), Path(tmp, "t.json")
        with open(src, "w") as f:
            for line in lines:
                f.write(json.dumps({**line, "body": {**line["body"], "temperature": 0}}) + "\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.cli_run", str(timings), "run", str(src),
                        "-o", str(out), "-q", "--restart", *cli_options], cwd=ROOT, env=env,
                       check=True)
        process = time.perf_counter() - start
        records = [json.loads(x) for x in out.read_text().splitlines()]
        metrics = json.loads(out.with_suffix(".metrics.json").read_text())
        timed = json.loads(timings.read_text())
    usage = [r["response"]["body"]["usage"] for r in records if r.get("response")]
    texts = [r["response"]["body"]["choices"][0]["message"]["content"] for r in records
             if r.get("response")]
    result = Result(label, metrics["wall_time_s"], sum(u["prompt_tokens"] for u in usage),
                    sum(u["completion_tokens"] for u in usage), None,
                    metrics.get("cache_hit_rate"))
    result.process_seconds, result.texts, result.timers = process, texts, timed
    result.steps = metrics.get("engine", {}).get("steps")
    return result


def main() -> None:
    timings, argv = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, str(ROOT))
    import batchrun.llm as llm
    from benchmarks import step_timers

    build_engine = llm.build_engine

    def timed_engine(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        step_timers.install(engine)
        return engine

    llm.build_engine = timed_engine
    from batchrun.cli import main as cli

    try:
        cli(argv, prog_name="batchrun")
    finally:
        Path(timings).write_text(json.dumps(dict(step_timers.SECONDS)))


if __name__ == "__main__":
    main()
