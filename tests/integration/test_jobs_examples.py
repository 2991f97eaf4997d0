"""The examples in jobs/ work: the nightly spec runs, the S3 spec resolves, the crontab lines
call real specs, and the Airflow DAG parses (where Airflow is installed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchrun.batch.shell.jobspec import load

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_nightly_spec_runs_and_a_rerun_is_a_no_op(tmp_path):
    cmd = [sys.executable, "-m", "tests.fake_batchrun", "job", str(JOBS / "nightly.toml"),
           "--var", f"out={tmp_path}", "--var", "date=2024-06-01"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    day = tmp_path / "nightly" / "2024-06-01"
    assert len((day / "results.jsonl").read_text().splitlines()) == 30
    metrics = json.loads((day / "results.metrics.json").read_text())
    assert metrics["requests"] == {"total": 30, "ok": 30, "failed": 0}
    assert "\r" not in proc.stderr and "progress: 30/30 lines" in proc.stderr
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "already completed" in proc.stderr


def test_s3_spec_resolves():
    opts = load(str(JOBS / "s3-parquet.toml"), {"bucket": "b", "date": "2024-06-01"})
    assert opts.inputs.input == ["s3://b/prompts/2024-06-01/*.parquet"]
    assert opts.job.output == "s3://b/results/2024-06-01/results.parquet"
    assert opts.inputs.columns == {"custom_id": "id", "prompt": "question",
                                   "system": "system_prompt"}
    assert opts.job.resume and opts.job.max_failed_fraction == 0.01


def test_crontab_lines_run_existing_specs():
    lines = [x for x in (JOBS / "crontab").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert len(lines) == 2
    for line in lines:
        fields = line.split()
        assert len(fields) > 5 and all(f == "*" or f.isdigit() for f in fields[:5])
        spec = fields[fields.index("job") + 1]
        assert (ROOT / spec).exists()
        assert "flock -n" in line and "--var date=" in line


def test_airflow_dag_parses():
    pytest.importorskip("airflow")
    from airflow.models import DagBag

    bag = DagBag(dag_folder=str(JOBS / "airflow_batchrun.py"), include_examples=False)
    assert bag.import_errors == {}
    dag = bag.get_dag("batchrun_nightly")
    assert dag is not None and dag.default_args["retries"] == 3
    assert [t.task_id for t in dag.tasks] == ["run_job"]
