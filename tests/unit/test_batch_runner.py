"""The batch job against a fake engine: same API, deterministic, finishes requests out of order."""

import gzip
import json

import pytest

from batchrun.batch.job.result import RequestCounts
from batchrun.batch.job.runner import run_batch
from batchrun.openai.params import RequestDefaults
from tests.helpers import job_plan
from tests.fake_engine import FakeEngine, fake_model
from tests.openai_batch_shape import error_of


def model(engine=None):
    return fake_model(engine)


def request(custom_id, content="Hello", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], **body}})


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run(tmp_path, lines, **options):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    engine = options.pop("engine", None) or FakeEngine()
    options.setdefault("progress", "none")
    config = job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), **options)
    result = run_batch(model(engine), config)
    return engine, result, read(tmp_path / "out.jsonl"), read(tmp_path / "out.errors.jsonl")


def test_output_is_in_input_order_although_completion_is_not(tmp_path):
    lines = [request(f"r{i}", max_tokens=20 - i) for i in range(20)]
    engine, _, out, errors = run(tmp_path, lines, max_in_flight=8)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(20)]
    assert errors == []
    finish_order = list(engine.added_when_finished)
    assert finish_order != sorted(finish_order, key=[a[0] for a in engine.added].index)
    for i, o in enumerate(out):
        assert set(o) == {"id", "custom_id", "response", "error"}
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["usage"]["completion_tokens"] == 20 - i
        assert o["response"]["body"]["model"] == "fake-model"


def test_bad_lines_go_to_the_error_file_in_order_and_the_job_goes_on(tmp_path):
    lines = [
        request("ok-1", max_tokens=5),
        "{not json",
        "",  # blank lines are skipped but still counted
        json.dumps({"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"max_tokens": 3}}),
        request("hot", temperature=5),
        request("ok-2", max_tokens=1),
        request("streams", stream=True),
        request("other-model", model="gpt-4o"),
        request("long", content="x" * 500),
        request("kv", content="KVFAIL", max_tokens=1),
        request("ok-3", max_tokens=2),
    ]
    _, result, out, errors = run(tmp_path, lines, max_in_flight=4)
    assert [o["custom_id"] for o in out] == ["ok-1", "ok-2", "ok-3"]
    by_line = {error_of(e)["line"]: e for e in errors}
    assert list(by_line) == [2, 4, 5, 7, 8, 9, 10]
    assert by_line[2]["custom_id"] is None and by_line[2]["response"] is None
    assert error_of(by_line[2])["code"] == "invalid_json"
    assert error_of(by_line[4])["message"] == "line 4: body.messages: field required"
    assert by_line[4]["response"]["status_code"] == 400
    assert error_of(by_line[5])["param"] == "temperature"
    assert error_of(by_line[7])["param"] == "stream"
    assert error_of(by_line[8])["code"] == "model_not_found"
    assert error_of(by_line[9])["code"] == "context_length_exceeded"
    assert by_line[10]["response"]["status_code"] == 500
    assert all(set(e) == {"id", "custom_id", "response", "error"} for e in errors)
    assert all(error_of(e)["line"] is not None for e in errors)
    assert result.requests == RequestCounts(10, 3, 7) and result.status == "completed"


def test_model_field_can_be_ignored_and_aliases_pass(tmp_path):
    lines = [request("a", model="gpt-4o", max_tokens=1), request("b", model="fm", max_tokens=1)]
    _, _, out, errors = run(tmp_path, lines, ignore_model_field=True)
    assert [o["custom_id"] for o in out] == ["a", "b"] and errors == []


def test_in_flight_is_bounded_and_a_slow_request_does_not_hold_back_the_rest(tmp_path):
    # Results are committed as they finish and merged into input order at the end, so the
    # short requests behind a long one keep flowing through the in-flight slots.
    lines = [request("slow", max_tokens=60)] + [request(f"f{i}", max_tokens=1) for i in range(40)]
    engine, _, out, _ = run(tmp_path, lines, max_in_flight=3, commit_every=4)
    assert engine.peak_in_flight == 3
    slow_id = engine.added[0][0]
    assert engine.added_when_finished[slow_id] == 41
    assert [o["custom_id"] for o in out] == ["slow"] + [f"f{i}" for i in range(40)]
    assert not (tmp_path / "out.jsonl.batchrun-staging").exists()


def test_defaults_apply_to_requests_that_leave_fields_out(tmp_path):
    lines = [request("a"), request("b", max_tokens=2, temperature=0.5)]
    engine, _, out, _ = run(tmp_path, lines,
                            defaults=RequestDefaults(temperature=0.0, max_tokens=3))
    params = [p for _, _, p in engine.added]
    assert [(p.temperature, p.max_tokens) for p in params] == [(0.0, 3), (0.5, 2)]


def test_metrics_file(tmp_path):
    lines = [request(f"r{i}", max_tokens=i + 1) for i in range(4)] + ["oops"]
    _, result, _, _ = run(tmp_path, lines)
    metrics = result.summary
    assert result.requests == RequestCounts(5, 4, 1)
    written = json.loads((tmp_path / "out.metrics.json").read_text())
    assert written == json.loads(json.dumps(metrics))
    assert metrics["requests"] == {"total": 5, "ok": 4, "failed": 1}
    assert metrics["completion_tokens"] == 1 + 2 + 3 + 4
    assert metrics["prompt_tokens"] > 0 and metrics["cached_tokens"] == 8
    assert metrics["ttft_s"] == {"p50": 1.0, "p90": 1.0}
    assert metrics["engine"]["steps"] > 0
    for key in ("wall_time_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert metrics[key] >= 0
    assert metrics["model"] == "fake-model"


def test_gzip_input_and_explicit_paths(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write(request("a", max_tokens=1) + "\n" + "bad\n")
    config = job_plan(input=str(src), output=str(tmp_path / "o" / "res.jsonl"),
                       errors=str(tmp_path / "e.jsonl"), metrics=str(tmp_path / "m.json"),
                       progress="none")
    run_batch(model(), config)
    assert [o["custom_id"] for o in read(tmp_path / "o" / "res.jsonl")] == ["a"]
    assert error_of(read(tmp_path / "e.jsonl")[0])["line"] == 2
    assert (tmp_path / "m.json").exists()


def test_progress_bar_runs(tmp_path, capsys):
    lines = [request(f"r{i}", max_tokens=1) for i in range(3)]
    run(tmp_path, lines, progress="bar")
    assert "3/3" in capsys.readouterr().err


def test_plain_log_progress_has_no_carriage_returns(tmp_path, caplog):
    lines = [request(f"r{i}", max_tokens=1) for i in range(3)] + ["bad"]
    with caplog.at_level("INFO", logger="batchrun.progress"):
        run(tmp_path, lines, progress="log", log_interval=0)
    messages = [r.getMessage() for r in caplog.records if r.name == "batchrun.progress"]
    assert messages and all("\r" not in m for m in messages)
    assert "4/4 lines (100%), 3 ok, 1 failed" in messages[-1]


def test_engine_crash_aborts_in_flight_requests_and_propagates(tmp_path):
    engine = FakeEngine(fail_on_step=2)
    with pytest.raises(RuntimeError, match="blew up"):
        run(tmp_path, [request(f"r{i}", max_tokens=5) for i in range(3)], engine=engine)
    assert len(engine.aborted) == 3


def test_an_engine_that_loses_requests_is_a_crash_not_a_hang(tmp_path):
    class Losing(FakeEngine):
        def add_request(self, request_id, prompt_token_ids, params, arrival_time=None):
            pass
    with pytest.raises(RuntimeError, match="dropped 1 requests"):
        run(tmp_path, [request("a", max_tokens=1)], engine=Losing())
