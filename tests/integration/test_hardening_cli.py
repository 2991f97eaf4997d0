"""Operator mistakes and hostile files through the CLI (fake engine): a clear message, the right
exit code, and nothing already there lost."""

import gzip
import json

from tests.helpers import batchrun


def line(custom_id, **fields):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], **fields}})


def test_output_equal_to_input_exits_2_and_leaves_the_input(tmp_path):
    src = tmp_path / "same.jsonl"
    src.write_text(line("a") + "\n")
    before = src.read_bytes()
    proc = batchrun("run", src, "-o", src)
    assert proc.returncode == 2 and b"is also an input" in proc.stderr
    assert src.read_bytes() == before


def test_existing_output_of_another_job_exits_2_unless_overwrite(tmp_path):
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "o.jsonl"
    a.write_text(line("a") + "\n")
    b.write_text(line("b") + "\n")
    assert batchrun("run", a, "-o", out, "-q").returncode == 0
    proc = batchrun("run", b, "-o", out, "-q")
    assert proc.returncode == 2 and str(out).encode() in proc.stderr
    assert b"--overwrite" in proc.stderr
    assert json.loads(out.read_text())["custom_id"] == "a"
    assert batchrun("run", a, "-o", out, "-q").returncode == 0  # its own job may rerun
    assert batchrun("run", b, "-o", out, "-q", "--overwrite").returncode == 0
    assert json.loads(out.read_text())["custom_id"] == "b"


def test_an_output_that_cannot_be_written_exits_2_before_the_model_loads(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(line("a") + "\n")
    (tmp_path / "blocker").write_text("")
    proc = batchrun("run", src, "-o", tmp_path / "blocker" / "out.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert b"loading model" not in proc.stderr  # the check came first
    assert b"blocker is not a folder" in proc.stderr and b"Traceback" not in proc.stderr


def test_a_truncated_gzip_commits_its_complete_lines_and_exits_1_naming_the_offset(tmp_path):
    data = "".join(line(f"r{i}") + "\n" for i in range(300)).encode()
    packed = gzip.compress(data)
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(packed[: len(packed) * 2 // 3])
    out = tmp_path / "out.jsonl"
    proc = batchrun("run", src, "-o", out, "-q")
    assert proc.returncode == 1
    assert b"in.jsonl.gz: the input breaks off after byte" in proc.stderr
    assert b"Traceback" not in proc.stderr and b"Aborted" not in proc.stderr
    src.write_bytes(packed)  # the whole file arrives: --resume runs only the rest
    proc = batchrun("run", src, "-o", out, "-q", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == \
        [f"r{i}" for i in range(300)]
    check = batchrun("validate", src)
    assert check.returncode == 0


def test_validate_reports_hostile_lines_without_a_traceback(tmp_path):
    src = tmp_path / "in.jsonl"
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": ' + \
        "[" * 10000 + "]" * 10000 + "}"
    src.write_text("\n".join([deep, line("bias", logit_bias={"²": 1}),
                              line("seed", seed=2 ** 70), line("ok")]) + "\n")
    proc = batchrun("validate", src)
    assert proc.returncode == 3 and b"Traceback" not in proc.stderr
    text = proc.stdout.decode()
    assert f"{src}:1: invalid_json" in text and f"{src}:2: invalid_value [logit_bias]" in text
    assert f"{src}:3: invalid_type [seed]" in text or f"{src}:3: invalid_value [seed]" in text
    assert "4 lines: 1 valid, 3 invalid" in proc.stderr.decode()
    broken = tmp_path / "cut.jsonl.gz"
    broken.write_bytes(gzip.compress("".join(line(f"r{i}") + "\n" for i in range(500))
                                     .encode())[:300])
    proc = batchrun("validate", broken)
    assert proc.returncode == 3 and b"breaks off" in proc.stderr
