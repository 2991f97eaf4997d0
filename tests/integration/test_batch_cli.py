"""`batchrun run|validate|job` as a scheduler sees them: subprocesses on the fake engine
(python -m tests.fake_batchrun), stdin/stdout, exit codes, signals, log output."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ENV, batchrun
from tests.openai_batch_shape import error_of

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"


def read(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def request(custom_id, max_tokens=1):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": custom_id}],
                                "max_tokens": max_tokens}})


def test_stdin_to_stdout_in_input_order_with_errors_inline():
    data = (SAMPLES / "malformed.jsonl").read_bytes()
    proc = batchrun("run", "-", "-o", "-", "--quiet", input=data)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert len(records) == 9
    assert [r["custom_id"] for r in records if error_of(r) is None] == ["valid-1", "valid-2"]
    assert [error_of(r)["line"] for r in records if error_of(r)] == [2, 3, 4, 5, 6, 7, 8]
    assert proc.stderr == b""


def test_gzip_stdin_with_input_format_and_a_separate_error_file(tmp_path):
    data = (SAMPLES / "chat.jsonl.gz").read_bytes()
    proc = batchrun("run", "-", "--input-format", "jsonl.gz", "-o", "-", "--errors",
                    tmp_path / "e.jsonl", "--ignore-model-field", "--progress", "none",
                    input=data)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.decode().splitlines()) == 30
    assert read(tmp_path / "e.jsonl") == []


@pytest.mark.parametrize("args,message", [
    (["missing.jsonl", "-o", "o.jsonl"], b"missing.jsonl does not exist"),
    (["sample_data/chat.jsonl", "-o", "o.csv", "--output-format", "csv"], b"--output-format"),
    (["sample_data/chat.jsonl", "-o", "o.jsonl", "--storage-options", "{nope"], b"not JSON"),
    (["sample_data/prompts.parquet", "-o", "o.jsonl"], b"no custom_id column"),
    (["sample_data/chat.jsonl", "-o", "o.jsonl", "--column", "oops"], b"NAME=VALUE"),
])
def test_usage_errors_exit_2(tmp_path, args, message):
    args = [a.replace("o.", str(tmp_path / "o.")) for a in args]
    proc = batchrun("run", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_max_failed_fraction_exit_code(tmp_path):
    src = SAMPLES / "malformed.jsonl"  # 7 of 9 lines fail
    proc = batchrun("run", src, "-o", tmp_path / "a.jsonl", "--max-failed-fraction", "0.5", "-q")
    assert proc.returncode == 3 and b"more than --max-failed-fraction" in proc.stderr
    assert len(read(tmp_path / "a.jsonl")) == 2  # the output is still written
    proc = batchrun("run", src, "-o", tmp_path / "b.jsonl", "--max-failed-fraction", "0.8", "-q")
    assert proc.returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_gracefully_then_resume_finishes(tmp_path, sig):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(request(f"r{i}", 1 + i % 5) for i in range(400)) + "\n")
    out = tmp_path / "out.jsonl"
    staging = tmp_path / "out.jsonl.batchrun-staging"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_batchrun", "run", src, "-o", out, "--commit-interval", "0.05",
         "--max-in-flight", "8", "--progress", "log", "--log-interval", "0.2"],
        cwd=ROOT, env={**ENV, "BATCHRUN_FAKE_STEP_S": "0.01"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(staging.glob("part-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert b"rerun with --resume" in err and b"\r" not in err
    assert not out.exists() and staging.exists()

    proc = batchrun("run", src, "-o", out)
    assert proc.returncode == 2 and b"--resume" in proc.stderr
    proc = batchrun("run", src, "-o", out, "--resume", "--progress", "log")
    assert proc.returncode == 0, proc.stderr
    assert [o["custom_id"] for o in read(out)] == [f"r{i}" for i in range(400)]
    assert b"committed earlier, 400 in the job" in proc.stderr
    assert b"\r" not in proc.stderr and b"progress: 400/400 lines (100%)" in proc.stderr


def test_validate_command(tmp_path):
    proc = batchrun("validate", SAMPLES / "malformed.jsonl")
    assert proc.returncode == 3
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 7
    assert lines[0].startswith(f"{SAMPLES / 'malformed.jsonl'}:2: invalid_json")
    assert any(":4: missing_required_parameter [messages]: body.messages:" in x for x in lines)
    assert b"9 lines: 2 valid, 7 invalid" in proc.stderr

    proc = batchrun("validate", "--json", SAMPLES / "malformed.jsonl")
    records = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert [error_of(r)["line"] for r in records] == [2, 3, 4, 5, 6, 7, 8]
    assert set(records[0]) == {"id", "custom_id", "response", "error"}

    # Several inputs are one job: custom_ids must be unique across them.
    proc = batchrun("validate", SAMPLES / "chat.jsonl", SAMPLES / "chat.parquet")
    assert proc.returncode == 3
    assert b"60 lines in 2 files: 30 valid, 30 invalid" in proc.stderr
    assert b"duplicate_custom_id: 30" in proc.stderr
    proc = batchrun("validate", SAMPLES / "chat.parquet", "-q")
    assert proc.returncode == 0 and proc.stdout == b"" and b"30 valid, 0 invalid" in proc.stderr
    proc = batchrun("validate", SAMPLES / "prompts.parquet", "--column", "custom_id=id",
                    "--column", "prompt=question")
    assert proc.returncode == 0 and b"6 lines: 6 valid" in proc.stderr


def test_job_spec_runs_with_paths_relative_to_the_spec(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_text(request("a") + "\n" + request("b", 2) + "\n")
    spec = tmp_path / "nightly.toml"
    spec.write_text('''
input = "data/*.jsonl"
output = "out/{date}/results.parquet"
resume = true
max_failed_fraction = 0.0
progress = "log"

[engine]
max_num_seqs = 4
kv_cache_memory = "64MiB"

[defaults]
temperature = 0
max_tokens = 8
''')
    proc = batchrun("job", spec, "--var", "date=2024-06-01")
    assert proc.returncode == 0, proc.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out" / "2024-06-01" / "results.parquet")
    assert table.column("custom_id").to_pylist() == ["a", "b"]
    assert (tmp_path / "out" / "2024-06-01" / "results.metrics.json").exists()

    # A scheduler's rerun of a completed job does nothing (and says so); --restart redoes it.
    proc = batchrun("job", spec, "--var", "date=2024-06-01")
    assert proc.returncode == 0 and b"already completed" in proc.stderr
    proc = batchrun("job", spec, "--var", "date=2024-06-01", "--restart")
    assert proc.returncode == 0 and b"already completed" not in proc.stderr

    proc = batchrun("job", spec, "--dry-run")
    resolved = json.loads(proc.stdout)
    assert resolved["input"] == [str(tmp_path / "data" / "*.jsonl")]
    assert resolved["kv_cache_memory"] == 64 << 20 and resolved["temperature"] == 0
    assert resolved["max_in_flight"] is None and resolved["resume"] is True


@pytest.mark.parametrize("text,message", [
    ('output = "o.jsonl"', b"`input` is required"),
    ('input = "a"\noutput = "o"\ncolour = 1', b"unknown key 'colour'"),
    ('input = "a"\noutput = "o"\n[engine]\nmax_num_seqs = "lots"',
     b"[engine]: max_num_seqs: Input should be a valid integer (got str 'lots')"),
    ('input = "a"\noutput = "{when}/o"', b"--var when="),
    ('input = [', b"nightly.toml"),
])
def test_bad_job_specs_are_usage_errors(tmp_path, text, message):
    spec = tmp_path / "nightly.toml"
    spec.write_text(text)
    proc = batchrun("job", spec)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
