"""The storage paths on the real bundled model: a flat Parquet table in, Parquet out; and
`validate --check-prompts` with the real tokenizer and chat template (no weights loaded)."""

import functools
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests import helpers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"


# The real CLI (`python -m batchrun`, the bundled model), text output.
batchrun = functools.partial(helpers.batchrun, real=True, text=True, timeout=600)


def test_flat_parquet_table_in_parquet_out(tmp_path):
    proc = batchrun("run", SAMPLES / "prompts.parquet", "-o", tmp_path / "out.parquet",
                    "--column", "custom_id=id", "--column", "prompt=question", "--quiet")
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["custom_id"] for r in rows] == ["1", "2", "3", "4", "5", "6"]
    assert "Paris" in rows[0]["content"]
    for r in rows:
        assert r["status_code"] == 200 and r["error"] is None
        body = json.loads(r["body"])
        assert body["model"] == "smollm2-135m" and body["object"] == "chat.completion"
        assert r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"]
        assert r["finish_reason"] in ("stop", "length")
    assert pq.read_table(tmp_path / "out.errors.parquet").num_rows == 0


def test_validate_checks_prompts_with_the_real_tokenizer(tmp_path):
    def line(cid, content, **body):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": content}], **body}})
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        line("short", "Hi", max_tokens=4),
        line("long", "lorem ipsum " * 60, max_tokens=4),
        line("too-much", "Hi", max_tokens=100),
        line("bad-role-order", "x", stream=True),
    ]) + "\n")
    fast = batchrun("validate", src, "--max-model-len", "64")
    assert fast.returncode == 3
    assert [x.split(": ")[0].rsplit(":", 1)[1] for x in fast.stdout.splitlines()] == ["4"]
    full = batchrun("validate", src, "--check-prompts", "--max-model-len", "64")
    assert full.returncode == 3, full.stderr
    problems = {int(x.split(": ")[0].rsplit(":", 1)[1]): x for x in full.stdout.splitlines()}
    assert sorted(problems) == [2, 3, 4]
    assert "context_length_exceeded" in problems[2] and "64 tokens" in problems[2]
    assert "context_length_exceeded [max_tokens]" in problems[3]
    assert "4 lines: 1 valid, 3 invalid" in full.stderr
