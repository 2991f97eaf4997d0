"""What Ray costs: rows per second through the --ray path with zero model time, and the bundled
model as 1 replica x 2 threads against 2 replicas x 1 thread, side by side.

    python benchmarks/ray_overhead.py --glue 100000        # RayEngineClient, instant engine
    python benchmarks/ray_overhead.py --cli 20000          # batchrun run on the fake engine
    python benchmarks/ray_overhead.py --model [WORKLOAD]   # bundled model, local vs Ray shapes

--glue pushes pre-tokenized requests through RayEngineClient (routing, batched adds, collects,
the replicas' loop) against the test suite's fake engine with max_tokens 1, so what it measures
is the glue. --cli runs the whole job (reading, validation, rendering, commits, merge) on the
fake engine, locally and with --ray, through `python -m tests.fake_batchrun`. --model runs
`batchrun run` over the HumanEval chat workload locally, then with --ray in both shapes (the
metrics' wall_time_s: the run, without loading the model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def glue(n: int, replicas: int, window: int = 4096) -> float:
    import ray

    from batchrun.distributed.client import RayEngineClient
    from batchrun.engine.sampling_params import SamplingParams
    from batchrun.options.engine import EngineConfig
    from batchrun.options.ray import RayOptions
    from tests.fake_engine import FakeEngine, fake_model

    def instant(model, config):
        return fake_model(FakeEngine(record=False), name="fake")

    ray.init(num_cpus=max(2, replicas), include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    client = RayEngineClient(RayOptions(ray=True, replicas=replicas, cpus_per_replica=0.5),
                             instant, None, EngineConfig())
    params = SamplingParams(max_tokens=1)
    prompts = [[(i * 7 + j) % 5000 for j in range(32)] for i in range(1000)]
    start, sent, done = time.perf_counter(), 0, 0
    while done < n:
        while sent < n and sent - done < window:
            client.add_request(f"r{sent}", prompts[sent % 1000], params)
            sent += 1
        done += len(client.step())
    seconds = time.perf_counter() - start
    client.shutdown()
    return n / seconds


def local_glue(n: int) -> float:
    from batchrun.engine.sampling_params import SamplingParams
    from tests.fake_engine import FakeEngine

    engine, params = FakeEngine(record=False), SamplingParams(max_tokens=1)
    prompts = [[(i * 7 + j) % 5000 for j in range(32)] for i in range(1000)]
    start, sent, done = time.perf_counter(), 0, 0
    while done < n:
        while sent < n and sent - done < 4096:
            engine.add_request(f"r{sent}", prompts[sent % 1000], params)
            sent += 1
        done += len([o for o in engine.step() if o.finished])
    return n / (time.perf_counter() - start)


def cli(n: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ray-cli-"))
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 1}})
        + "\n" for i in range(n)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for label, extra in (("local", []), ("--ray, 1 replica", ["--ray", "--replicas", "1"]),
                         ("--ray, 2 replicas", ["--ray", "--replicas", "2",
                                                "--cpus-per-replica", "0.5"])):
        out = tmp / f"{len(extra)}.jsonl"
        subprocess.run([sys.executable, "-m", "tests.fake_batchrun", "run", str(src), "-o",
                        str(out), "-q", *extra], cwd=ROOT, env=env, check=True)
        metrics = json.loads((tmp / f"{len(extra)}.metrics.json").read_text())
        print(f"cli {label:18s} {n:,} rows: {metrics['wall_time_s']:.1f} s, "
              f"{n / metrics['wall_time_s']:,.0f} rows/s")


def model(workload: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ray-model-"))
    shapes = (("local (2 threads)", []),
              ("--ray 1 replica x 2 threads", ["--ray", "--replicas", "1",
                                               "--cpus-per-replica", "2"]),
              ("--ray 2 replicas x 1 thread", ["--ray", "--replicas", "2",
                                               "--cpus-per-replica", "1"]))
    for n, (label, extra) in enumerate(shapes):
        out = tmp / f"{n}.jsonl"
        subprocess.run([sys.executable, "-m", "batchrun", "run", workload, "-o", str(out), "-q",
                        *extra], cwd=ROOT, check=True)
        m = json.loads((tmp / f"{n}.metrics.json").read_text())
        print(f"model {label:30s} {m['wall_time_s']:7.1f} s  {m['output_tokens_per_s']:6.1f} "
              f"output tok/s  cache hit {m['cache_hit_rate']:.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--glue", type=int, metavar="N")
    ap.add_argument("--cli", type=int, metavar="N")
    ap.add_argument("--model", nargs="?", const="", metavar="WORKLOAD")
    args = ap.parse_args()
    print(f"CPU: {os.cpu_count()} cores; " + next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
         if line.startswith("model name")), "?"))
    if args.glue:
        print(f"glue local fake engine      {local_glue(args.glue):,.0f} rows/s")
        for replicas in (1, 2):
            print(f"glue RayEngineClient x{replicas}     {glue(args.glue, replicas):,.0f} rows/s",
                  flush=True)
    if args.cli:
        cli(args.cli)
    if args.model is not None:
        from benchmarks.workloads import workload_path

        model(args.model or workload_path("humaneval_chat.jsonl"))


if __name__ == "__main__":
    main()
