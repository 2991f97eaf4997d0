"""The bench's `batchrun-run` system: the whole CLI path users run (a fresh process: imports,
model load, reading the input file, rendering, the engine, committing, merging into the output
file), with the bench's step timers on the engine the CLI builds.

    python benchmarks/cli_run.py TIMINGS.json run IN.jsonl -o OUT.jsonl [run options]

runs `batchrun run ...` and writes the timers' seconds to TIMINGS.json; `run_cli(...)` is what
bench.py calls. With a git revision (the bench's `batchrun-run@REV`), the CLI runs that
revision's `batchrun` package (extracted with `git archive`) instead of this checkout's: the
code as it was, on the same machine in the same run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_at(revision: str, into: Path) -> Path:
    """`batchrun/` as it is at git `revision`, extracted under `into`; returns `into`."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "batchrun"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def capped_kernels_env(tmp: Path) -> dict[str, str]:
    """For a revision older than BATCHRUN_SIMD, with the cap set: a C compiler that adds the
    cap's flags, and a cache folder of its own for the kernels (the rest linked to this cache),
    so that revision's kernels are built under the cap too. Empty without a cap."""
    from batchrun.engine import kernels
    from batchrun.paths import cache_dir

    flags = kernels.simd_cap()
    if not flags:
        return {}
    wrapper = tmp / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {kernels.compiler()} "$@" {" ".join(flags)}\n')
    wrapper.chmod(0o755)
    cache = tmp / "cache"
    cache.mkdir()
    real = cache_dir()
    for entry in real.iterdir() if real.exists() else ():
        if entry.name != "kernels":
            (cache / entry.name).symlink_to(entry)
    return {"CC": str(wrapper), "BATCHRUN_CACHE": str(cache)}


def run_cli(lines: list[dict], cli_options: list[str], label: str = "batchrun-run",
            revision: str | None = None):
    """Run `lines` (chat batch lines, greedy) through `batchrun run` in a subprocess (this
    checkout's package, or git `revision`'s); a bench Result (seconds: the run itself, from its
    metrics file) plus the process's seconds and the timer shares."""
    from benchmarks.results import Result

    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        src, out, timings = Path(tmp, "in.jsonl"), Path(tmp, "out.jsonl"), Path(tmp, "t.json")
        with open(src, "w") as f:
            for line in lines:
                f.write(json.dumps({**line, "body": {**line["body"], "temperature": 0}}) + "\n")
        code = [str(package_at(revision, Path(tmp, "code")))] if revision else []
        env = {**os.environ, **(capped_kernels_env(Path(tmp)) if revision else {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [*code, str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        # Run as a script, not with -m: -m would put the working directory (this checkout)
        # ahead of PYTHONPATH's revision.
        subprocess.run([sys.executable, str(Path(__file__).resolve()), str(timings), "run",
                        str(src), "-o", str(out), "-q", "--restart", *cli_options], cwd=ROOT,
                       env=env, check=True)
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
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # the script's folder, not a package root
    import batchrun.llm as llm
    from benchmarks import step_timers

    build_engine = llm.build_engine

    def timed_engine(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        # An older revision's engine may lack what the timers wrap: it then runs untimed.
        with contextlib.suppress(AttributeError, ImportError):
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
