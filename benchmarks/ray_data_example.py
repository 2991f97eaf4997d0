"""batchrun as a Ray Data stage, end to end: a JSONL batch file -> a Ray Dataset -> the
processor on engine replicas -> Parquet.

    python -m benchmarks.ray_data_example                       # sample_data/chat.jsonl, 2 replicas
    python -m benchmarks.ray_data_example FILE.jsonl -o OUT_DIR --replicas 4 --cpus-per-replica 2
    python -m benchmarks.ray_data_example --fake                # the test suite's instant engine

The file is read with `ray.data.read_text` (one row per line, column "text"), not Ray's JSON
reader: a malformed line then becomes one error row instead of failing the job. The results are
written with `Dataset.write_parquet` (one file per block) in the columns of batchrun's Parquet
output (custom_id, status_code, content, finish_reason, token counts, body, error). It prints the
row counts, the wall time (Ray start and model loads included, and without them) and rows/s.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", nargs="?", default=str(ROOT / "sample_data" / "chat.jsonl"))
    ap.add_argument("-o", "--output", default="/tmp/batchrun-ray-data-example")
    ap.add_argument("--model", default=None, help="[default: the bundled model]")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--gpus-per-replica", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--fake", action="store_true", help="the test suite's fake engine")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    import ray

    from batchrun.batch.ray_data import build_processor

    load = None
    if args.fake:
        from tests.fake_engine import load
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    t_ray = time.perf_counter()

    processor = build_processor(
        args.model, engine={"max_num_seqs": args.max_num_seqs}, replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
        batch_size=args.batch_size, load=load)
    # The replicas may hold every CPU (2 x 1 on a 2-core machine): reading and writing are I/O,
    # so they reserve none, or they would wait for a CPU forever.
    io = {"num_cpus": 0}
    ds = processor(ray.data.read_text(args.input, ray_remote_args=io))
    shutil.rmtree(args.output, ignore_errors=True)
    ds.write_parquet(args.output, ray_remote_args=io)
    t_done = time.perf_counter()

    import pyarrow.parquet as pq

    table = pq.read_table(args.output)
    ok = sum(1 for s in table.column("status_code").to_pylist() if s == 200)
    tokens = sum(t or 0 for t in table.column("completion_tokens").to_pylist())
    wall = t_done - t0
    print(f"{table.num_rows} rows ({ok} ok, {table.num_rows - ok} errors), {tokens} completion "
          f"tokens -> {args.output}")
    print(f"wall {wall:.1f} s (Ray start {t_ray - t0:.1f} s), {table.num_rows / wall:.2f} rows/s, "
          f"{tokens / wall:.1f} completion tokens/s; after Ray start: "
          f"{t_done - t_ray:.1f} s, {table.num_rows / (t_done - t_ray):.2f} rows/s")
    ray.shutdown()


if __name__ == "__main__":
    main()
