"""Parquet in (batch columns, struct bodies, flat tables with --column) and out (result rows)."""

import io as _io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.batch.storage.parquet import RESULT_SCHEMA, ParquetRecordWriter
from batchrun.batch.job.runner import BatchConfigError, run_batch
from batchrun.batch.job.result import RequestCounts
from batchrun.openai.params import RequestDefaults
from tests.helpers import job_plan
from tests.fake_engine import FakeEngine, fake_model
from tests.openai_batch_shape import error_of

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"


def run(tmp_path, src, output="out.jsonl", engine=None, **options):
    options.setdefault("progress", "none")
    config = job_plan(input=str(src), output=str(tmp_path / output), ignore_model_field=True,
                       **options)
    return run_batch(fake_model(engine or FakeEngine()), config)


def read_jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def strip_ids(records):
    """Records without the fields that are fresh per run (ids, timestamps)."""
    out = []
    for r in records:
        body = dict(r["response"]["body"])
        for key in ("id", "created"):
            body.pop(key)
        out.append((r["custom_id"], json.dumps(body, sort_keys=True)))
    return out


def test_batch_columns_parquet_gives_the_same_results_as_the_jsonl(tmp_path):
    run(tmp_path, SAMPLES / "chat.jsonl", "a.jsonl")
    run(tmp_path, SAMPLES / "chat.parquet", "b.jsonl")
    run(tmp_path, SAMPLES / "chat.jsonl.gz", "c.jsonl")
    a = strip_ids(read_jsonl(tmp_path / "a.jsonl"))
    assert len(a) == 30
    assert strip_ids(read_jsonl(tmp_path / "b.jsonl")) == a
    assert strip_ids(read_jsonl(tmp_path / "c.jsonl")) == a


def test_struct_bodies_and_bad_json_bodies(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "custom_id": ["a", "b", "c"],
        "body": pa.array([
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": None},
            {"messages": [{"role": "user", "content": "yo"}], "max_tokens": None,
             "temperature": 0.5},
            {"messages": [], "max_tokens": 1, "temperature": None},
        ]),
    }), src)
    result = run(tmp_path, src, defaults=RequestDefaults(max_tokens=3))
    assert [o["custom_id"] for o in read_jsonl(tmp_path / "out.jsonl")] == ["a", "b"]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error_of(errors[0])["line"] == 3 and error_of(errors[0])["param"] == "messages"
    assert result.requests == RequestCounts(3, 2, 1)

    src2 = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"custom_id": ["x", "y"],
                             "body": ['{"messages": [{"role": "user", "content": "a"}]}',
                                      '{"messages": ']}), src2)
    run(tmp_path, src2, "bad.jsonl", defaults=RequestDefaults(max_tokens=1))
    errors = read_jsonl(tmp_path / "bad.errors.jsonl")
    assert [(e["custom_id"], error_of(e)["line"], error_of(e)["code"]) for e in errors] == [
        ("y", 2, "invalid_json")]


def test_flat_table_with_column_mappings(tmp_path):
    engine = FakeEngine()
    run(tmp_path, SAMPLES / "prompts.parquet", engine=engine,
        columns={"custom_id": "id", "prompt": "question"})
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in out] == ["1", "2", "3", "4", "5", "6"]
    assert [o["response"]["body"]["usage"]["completion_tokens"] for o in out] == [
        24, 8, 8, 16, 16, 8]
    params = [p for _, _, p in engine.added]
    assert all(p.temperature == 0.0 for p in params)
    prompts = [bytes(ids).decode() for _, ids, _ in engine.added]
    assert prompts[0] == "user:What is the capital of France?\nassistant:"
    assert prompts[1].startswith("system:Answer in one word.\nuser:Name a primary colour.")


def test_flat_table_with_a_messages_column(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "key": ["m1", "m2"],
        "conversation": [[{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"}],
                         [{"role": "user", "content": "Bye"}]],
        "max_tokens": [1, 2],
    }), src)
    run(tmp_path, src, columns={"custom_id": "key", "messages": "conversation"})
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [(o["custom_id"], o["response"]["body"]["usage"]["completion_tokens"]) for o in out] \
        == [("m1", 1), ("m2", 2)]


def test_unusable_tables_are_usage_errors(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["hi"]}), src)
    with pytest.raises(BatchConfigError, match="no custom_id column"):
        run(tmp_path, src)
    with pytest.raises(BatchConfigError, match="needs a body column"):
        run(tmp_path, src, columns={"custom_id": "id"})
    with pytest.raises(BatchConfigError, match="has no column 'nope'"):
        run(tmp_path, src, columns={"custom_id": "nope"})
    with pytest.raises(BatchConfigError, match="not a request field"):
        run(tmp_path, src, columns={"colour": "text"})


def test_parquet_output_schema_round_trip(tmp_path):
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "x" * i}],
                                  "max_tokens": i + 1}}) for i in range(3)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\nnot json\n")
    run(tmp_path, src, "out.parquet")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.equals(RESULT_SCHEMA)
    rows = table.to_pylist()
    assert [r["custom_id"] for r in rows] == ["r0", "r1", "r2"]
    assert [r["completion_tokens"] for r in rows] == [1, 2, 3]
    assert all(r["status_code"] == 200 and r["error"] is None for r in rows)
    assert rows[0]["content"].startswith("echo") and rows[0]["finish_reason"] == "length"
    body = json.loads(rows[2]["body"])
    assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] == rows[2][
        "total_tokens"] == rows[2]["prompt_tokens"] + 3
    assert rows[1]["cached_tokens"] == 2
    errors = pq.read_table(tmp_path / "out.errors.parquet").to_pylist()
    assert len(errors) == 1 and errors[0]["custom_id"] is None
    assert json.loads(errors[0]["error"])["code"] == "invalid_json"


def test_parquet_writer_writes_row_groups_incrementally():
    buf = _io.BytesIO()
    writer = ParquetRecordWriter(buf, row_group_rows=10)
    for i in range(25):
        writer.write_record(json.dumps({"id": str(i), "custom_id": f"c{i}", "response": None,
                                        "error": {"code": "x", "message": "m"}}))
    writer.close()
    meta = pq.ParquetFile(_io.BytesIO(buf.getvalue())).metadata
    assert meta.num_rows == 25 and meta.num_row_groups == 3
