"""S3 round trips against a real S3 API on loopback (moto's server, started here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun.batch.job.loop import StopRequest
from batchrun.batch.job.runner import run_batch
from batchrun.batch.job.result import RequestCounts
from tests.helpers import job_plan
from tests.fake_engine import FakeEngine, fake_model
from tests.openai_batch_shape import error_of

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"


@pytest.fixture(scope="module")
def s3():
    """(fs, storage_options) for a fresh moto S3 server on 127.0.0.1, holding the samples."""
    from tests.moto_s3 import moto_s3

    with moto_s3() as (fs, options):
        fs.put(str(SAMPLES / "chat.jsonl"), "bkt/in/chat.jsonl")
        fs.put(str(SAMPLES / "malformed.jsonl"), "bkt/in/malformed.jsonl")
        fs.put(str(SAMPLES / "chat.parquet"), "bkt/pq/chat.parquet")
        fs.put(str(SAMPLES / "chat.jsonl.gz"), "bkt/gz/chat.jsonl.gz")
        yield fs, options


def lines(fs, path):
    fs.invalidate_cache()
    return [json.loads(x) for x in fs.cat(path).decode().splitlines()]


def config(options, inputs, output, **kw):
    kw.setdefault("progress", "none")
    return job_plan(input=inputs, output=output, storage_options=options,
                     ignore_model_field=True, **kw)


def test_jsonl_glob_in_jsonl_out_on_s3(s3):
    fs, options = s3
    result = run_batch(fake_model(), config(options, "s3://bkt/in/*.jsonl", "s3://bkt/o1/out.jsonl"))
    out = lines(fs, "bkt/o1/out.jsonl")
    assert len(out) == 30 + 2 and out[0]["custom_id"] == "capital-france"
    errors = lines(fs, "bkt/o1/out.errors.jsonl")
    assert [error_of(e)["line"] for e in errors] == [2, 3, 4, 5, 6, 7, 8]
    assert error_of(errors[0])["message"].startswith("s3://bkt/in/malformed.jsonl: line 2")
    metrics = json.loads(fs.cat("bkt/o1/out.metrics.json"))
    assert result.requests == RequestCounts(39, 32, 7)
    assert metrics == result.summary  # the metrics file holds the summary, key for key
    fs.invalidate_cache()
    assert sorted(fs.ls("bkt/o1")) == ["bkt/o1/out.errors.jsonl", "bkt/o1/out.jsonl",
                                       "bkt/o1/out.metrics.json"]


def test_parquet_in_parquet_out_on_s3(s3):
    fs, options = s3
    run_batch(fake_model(), config(options, "s3://bkt/pq/chat.parquet", "s3://bkt/o2/out.parquet"))
    fs.invalidate_cache()
    with fs.open("bkt/o2/out.parquet", "rb") as f:
        rows = pq.read_table(f).to_pylist()
    assert len(rows) == 30 and rows[0]["custom_id"] == "capital-france"
    assert all(r["status_code"] == 200 and r["content"] for r in rows)


def test_gzip_in_from_s3_parquet_out_locally(s3, tmp_path):
    fs, options = s3
    run_batch(fake_model(), config(options, "s3://bkt/gz/chat.jsonl.gz",
                                   str(tmp_path / "out.parquet")))
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 30


def test_resume_on_s3(s3):
    fs, options = s3
    stop = StopRequest()
    calls = []

    def on_progress(counts):
        calls.append(counts)
        if len(calls) == 2:
            stop.set()
    cfg = config(options, "s3://bkt/in/chat.jsonl", "s3://bkt/o3/out.jsonl", commit_every=4,
                 max_in_flight=4, grace_period=0)
    first = run_batch(fake_model(), cfg, stop=stop, on_progress=on_progress)
    assert first.status == "interrupted"
    fs.invalidate_cache()
    parts = fs.glob("bkt/o3/out.jsonl.batchrun-staging/part-*.jsonl")
    assert parts and not fs.exists("bkt/o3/out.jsonl")

    engine = FakeEngine()
    second = run_batch(fake_model(engine), config(
        options, "s3://bkt/in/chat.jsonl", "s3://bkt/o3/out.jsonl", commit_every=4,
        max_in_flight=4, grace_period=0, resume=True))
    done = first.requests.total
    assert second.summary["resumed"] == done and len(engine.added) == 30 - done
    out = lines(fs, "bkt/o3/out.jsonl")
    assert [o["custom_id"] for o in out] == [
        json.loads(x)["custom_id"] for x in (SAMPLES / "chat.jsonl").read_text().splitlines()]
    fs.invalidate_cache()
    assert not fs.exists("bkt/o3/out.jsonl.batchrun-staging")


def test_cli_with_storage_options(s3):
    fs, options = s3
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fake_batchrun", "run", "s3://bkt/in/chat.jsonl", "-o",
         "s3://bkt/o4/out.jsonl", "--storage-options", json.dumps(options), "--quiet",
         "--ignore-model-field"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(lines(fs, "bkt/o4/out.jsonl")) == 30
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fake_batchrun", "validate", "s3://bkt/in/malformed.jsonl",
         "--storage-options", json.dumps(options)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 3 and "9 lines: 2 valid, 7 invalid" in proc.stderr


def test_plan_reads_s3_inputs(s3):
    from click.testing import CliRunner

    from batchrun.batch.shell.commands import plan
    from batchrun.batch.estimate.job_estimate import run_key
    from batchrun.batch.estimate.run_store import save_run
    from batchrun.options.engine import EngineConfig

    save_run({"status": "completed", "requests": {"total": 1, "ok": 1, "failed": 0},
              "prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 0,
              "wall_time_s": 1.0, "engine": {"steps": 10}},
             run_key("smollm2-135m", EngineConfig()))
    fs, options = s3
    args = ["--storage-options", json.dumps(options), "--json"]
    result = CliRunner().invoke(plan, ["s3://bkt/in/chat.jsonl", *args])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["inputs"][0]["path"] == "s3://bkt/in/chat.jsonl"
    assert got["inputs"][0]["bytes"] == (SAMPLES / "chat.jsonl").stat().st_size
    assert (got["lines"], got["valid"], got["prompt_tokens"]) == (30, 30, 1401)
    pq_result = CliRunner().invoke(plan, ["s3://bkt/pq/chat.parquet", *args])
    assert pq_result.exit_code == 0, pq_result.output
    assert json.loads(pq_result.stdout)["prompt_tokens"] == 1401
