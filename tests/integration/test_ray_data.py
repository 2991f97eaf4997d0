"""The Ray Data processor (batchrun/batch/ray_data.py) on a local Ray instance: every row
back once, the same results as `batchrun run` on the same inputs (the fake engine; one test on
the real bundled model), bad rows as error rows, schema and option errors before Ray runs."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

from batchrun.batch.storage.parquet import RESULT_SCHEMA  # noqa: E402
from batchrun.batch.job.runner import run_batch  # noqa: E402
from batchrun.batch.ray_data import build_processor  # noqa: E402
from batchrun.options.fields import OptionsError  # noqa: E402
from tests import fake_engine  # noqa: E402
from tests.helpers import job_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"
COMPARED = ("custom_id", "status_code", "content", "finish_reason", "prompt_tokens",
            "completion_tokens", "total_tokens", "cached_tokens")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One Ray instance for the module (it takes seconds to start)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def local_run(tmp_path, model, **options):
    """`batchrun run` in-process: (results, errors) as Parquet rows by the writer's columns."""
    out, err = tmp_path / "local.parquet", tmp_path / "local.errors.parquet"
    run_batch(model, job_plan(output=str(out), errors=str(err), quiet=True, **options))
    return pq.read_table(out).to_pylist(), pq.read_table(err).to_pylist()


def batch_rows(path, limit=None):
    """A JSONL batch file's lines as Dataset rows, the body as JSON text (bodies of different
    shapes do not share one Arrow struct type)."""
    rows = []
    for text in Path(path).read_text().splitlines()[:limit]:
        line = json.loads(text)
        rows.append({**line, "body": json.dumps(line["body"])})
    return rows


def by_id(rows, compared=COMPARED):
    return {r["custom_id"]: {k: r[k] for k in compared} for r in rows}


def test_batch_columns_match_a_local_run(tmp_path):
    processor = build_processor(engine={"max_num_seqs": 8}, replicas=2, cpus_per_replica=0.5,
                                batch_size=7, load=fake_engine.load)
    out = processor(ray.data.from_items(batch_rows(SAMPLES / "chat.jsonl"))).take_all()
    assert len(out) == 30 and len({r["custom_id"] for r in out}) == 30
    assert set(out[0]) == set(RESULT_SCHEMA.names)
    local, errors = local_run(tmp_path, fake_engine.load(None, None),
                              input=str(SAMPLES / "chat.jsonl"))
    assert errors == []
    assert by_id(out) == by_id(local)
    assert all(r["status_code"] == 200 and r["error"] is None for r in out)
    body = json.loads(out[0]["body"])
    assert body["object"] == "chat.completion" and body["model"] == "smollm2-135m"


def test_a_flat_table_with_column_mappings_matches_the_parquet_input(tmp_path):
    table = pq.read_table(SAMPLES / "prompts.parquet")
    columns = {"custom_id": "id", "prompt": "question"}
    processor = build_processor(columns=columns, carry=["question"], batch_size=4,
                                cpus_per_replica=0.5, load=fake_engine.load)
    out = processor(ray.data.from_arrow(table)).take_all()
    local, errors = local_run(tmp_path, fake_engine.load(None, None),
                              input=str(SAMPLES / "prompts.parquet"), columns=columns)
    assert errors == [] and len(out) == table.num_rows
    assert by_id(out) == by_id(local)
    questions = dict(zip(map(str, table.column("id").to_pylist()),
                         table.column("question").to_pylist()))
    assert {r["custom_id"]: r["question"] for r in out} == questions


def test_malformed_lines_become_error_rows_naming_the_field(tmp_path):
    lines = (SAMPLES / "malformed.jsonl").read_text().splitlines()
    processor = build_processor(batch_size=4, cpus_per_replica=0.5, load=fake_engine.load)
    out = processor(ray.data.from_items([{"text": t} for t in lines])).take_all()
    assert len(out) == len(lines)
    ok = {r["custom_id"] for r in out if r["status_code"] == 200}
    assert ok == {"valid-1", "valid-2"}
    errors = {r["custom_id"]: json.loads(r["error"]) for r in out if r["error"]}
    assert errors["too-hot"]["param"] == "temperature"
    assert errors["max-tokens-string"]["param"] == "max_tokens"
    assert errors["no-messages"]["param"] == "messages"
    assert errors["wants-stream"]["param"] == "stream"
    # The same errors as the local run's error file (which also names the line).
    _, local_errors = local_run(tmp_path, fake_engine.load(None, None),
                                input=str(SAMPLES / "malformed.jsonl"))

    def key(r):
        e = json.loads(r["error"])
        return (r["custom_id"] or "", r["status_code"] or 0, e["code"], e["param"] or "")
    assert sorted(map(key, (r for r in out if r["error"]))) == sorted(map(key, local_errors))
    row = next(r for r in out if r["custom_id"] == "too-hot")
    assert row["status_code"] == 400 and row["content"] is None
    assert json.loads(row["body"])["error"]["param"] == "temperature"
    # The error column holds the body's error; a Dataset row has no line number to name.
    assert json.loads(row["error"]) == json.loads(row["body"])["error"]
    assert not json.loads(row["error"])["message"].startswith("line ")


def test_bad_cells_and_engine_refusals_fail_their_row_only():
    rows = [{"custom_id": "ok", "messages": '[{"role": "user", "content": "hi"}]'},
            {"custom_id": "bad-json", "messages": '[{"role": '},
            {"custom_id": "too-long", "messages": json.dumps([{"role": "user",
                                                                "content": "x" * 500}])}]
    processor = build_processor(cpus_per_replica=0.5, load=fake_engine.load,
                                defaults={"max_tokens": 3})
    out = {r["custom_id"]: r for r in processor(ray.data.from_items(rows)).take_all()}
    assert out["ok"]["status_code"] == 200 and out["ok"]["completion_tokens"] == 3
    assert json.loads(out["bad-json"]["error"])["code"] == "invalid_json"
    assert json.loads(out["bad-json"]["error"])["param"] == "messages"
    assert json.loads(out["too-long"]["error"])["code"] == "context_length_exceeded"


def test_schema_and_option_errors_come_before_any_work():
    processor = build_processor(load=fake_engine.load)
    with pytest.raises(ValueError, match="no custom_id column"):
        processor(ray.data.from_items([{"question": "hi"}]))
    with pytest.raises(ValueError, match="no column 'nope'"):
        build_processor(load=fake_engine.load, carry=["nope"])(
            ray.data.from_items([{"text": "{}"}]))
    with pytest.raises(OptionsError, match="max_num_seq"):
        build_processor(engine={"max_num_seq": 4})
    with pytest.raises(OptionsError, match="replicas"):
        build_processor(replicas=0)
    with pytest.raises(ValueError, match="not a request field"):
        build_processor(columns={"question": "q"})


@pytest.mark.slow
def test_the_real_model_gives_the_local_runs_content(tmp_path, real_model):
    from batchrun.commandkit import load_model

    lines = []
    for text in (SAMPLES / "chat.jsonl").read_text().splitlines()[:4]:
        line = json.loads(text)
        line["body"].update(max_tokens=8, temperature=0)
        lines.append(line)
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    processor = build_processor(replicas=1, cpus_per_replica=2, load=load_model)
    out = processor(ray.data.from_items(batch_rows(path))).take_all()
    local, errors = local_run(tmp_path, real_model, input=str(path))
    assert errors == [] and len(out) == 4
    # cached_tokens depends on what the session's shared model ran before.
    compared = tuple(k for k in COMPARED if k != "cached_tokens")
    assert by_id(out, compared) == by_id(local, compared)
    assert all(r["content"] for r in out)
