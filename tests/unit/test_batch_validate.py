"""The malformed-input corpus: every bad line becomes an error record with its line number, valid
lines succeed, and `validate` reports exactly what the run rejects."""

import json

from batchrun.batch.storage.readers import open_sources
from batchrun.openai.serving import OpenAIServing
from batchrun.options.openai import OpenAIOptions
from batchrun.batch.job.runner import check_line, prepare_line, run_batch
from batchrun.batch.job.validate import served_names, summary, validate
from tests.helpers import job_plan
from tests.fake_engine import fake_model
from tests.openai_batch_shape import error_of


def line(custom_id, body=None, **envelope):
    obj = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
           "body": body if body is not None else {
               "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}
    obj.update(envelope)
    return json.dumps(obj).encode()


def msgs(content="Hi"):
    return [{"role": "user", "content": content}]


# (bytes of the line, expected error code or None for a valid line)
CORPUS = [
    (line("ok-1"), None),
    (b'{"custom_id": "bad-json", "method": "POST"', "invalid_json"),
    (b"", "blank"),
    (b"   ", "blank"),
    (line("bad-utf8")[:-2] + b'\xff"}', "invalid_encoding"),
    (b'["not", "an", "object"]', "invalid_json"),
    (json.dumps({"method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": msgs()}}).encode(), "missing_required_parameter"),
    (line("no-messages", {"max_tokens": 3}), "missing_required_parameter"),
    (line("wrong-type", {"messages": msgs(), "max_tokens": "10"}), "invalid_type"),
    (line(12345), "invalid_type"),
    (line("unknown-url", url="/v1/nowhere"), "invalid_url"),
    (line("moderations", url="/v1/moderations"), "unsupported_endpoint"),
    (line("get", method="GET"), "invalid_value"),
    (line("ok-1"), "duplicate_custom_id"),
    (line("too-long", {"messages": msgs("x" * 1000), "max_tokens": 2}),
     "context_length_exceeded"),
    (line("too-hot", {"messages": msgs(), "temperature": 3}), "invalid_value"),
    (line("bad-top-p", {"messages": msgs(), "top_p": 0}), "invalid_value"),
    (line("bad-role", {"messages": [{"role": "wizard", "content": "x"}]}), "invalid_value"),
    (line("streams", {"messages": msgs(), "stream": True}), "unsupported_value"),
    (line("ok-2"), None),
]


def write_corpus(tmp_path):
    src = tmp_path / "corpus.jsonl"
    src.write_bytes(b"\n".join(data for data, _ in CORPUS) + b"\n")
    return src


def expected():
    return {i + 1: code for i, (_, code) in enumerate(CORPUS) if code not in (None, "blank")}


def test_every_bad_line_is_an_error_record_and_valid_lines_succeed(tmp_path):
    src = write_corpus(tmp_path)
    run_batch(fake_model(), job_plan(input=str(src), output=str(tmp_path / "out.jsonl"),
                                      progress="none"))
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["ok-1", "ok-2"]
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert {error_of(e)["line"]: error_of(e)["code"] for e in errors} == expected()
    for e in errors:
        assert error_of(e)["message"].startswith(f"line {error_of(e)['line']}: ")
    by_code = {error_of(e)["code"]: e for e in errors}
    assert by_code["invalid_encoding"]["custom_id"] == "bad-utf8"  # its readable custom_id
    assert by_code["duplicate_custom_id"]["custom_id"] == "ok-1"


def test_validate_reports_exactly_what_the_run_rejects(tmp_path):
    src = write_corpus(tmp_path)
    sources = open_sources([str(src)])
    model = fake_model()
    serving = OpenAIServing(model)
    problems = []
    report = validate(sources, lambda text, n: prepare_line(text, n, serving),
                      lambda item, exc: problems.append((item.line, exc.code, exc.param)))
    assert {n: code for n, code, _ in problems} == expected()
    assert report.lines == len(CORPUS) - 2 and report.valid == 2
    assert "18 lines: 2 valid, 16 invalid" in summary(report, 1)

    # Without a tokenizer every problem but the prompt length is still found.
    fast = []
    report = validate(sources, lambda text, n: check_line(text, n, model, OpenAIOptions())[0],
                      lambda item, exc: fast.append((item.line, exc.code)))
    assert dict(fast) == {n: c for n, c in expected().items() if c != "context_length_exceeded"}


def test_served_names_come_from_the_registry_without_loading():
    names = served_names(None)
    assert names.name == "smollm2-135m" and "HuggingFaceTB/SmolLM2-135M-Instruct" in names.aliases
    assert served_names("./some/folder") is None
