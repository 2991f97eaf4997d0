"""`batchrun run` end to end on the bundled model, through `python -m batchrun` in a subprocess."""

import functools
import json
import subprocess
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from tests import helpers
from tests.openai_batch_shape import error_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"
BATCH_KEYS = {"id", "custom_id", "response", "error"}


# The real CLI (`python -m batchrun`, the bundled model), text output.
batchrun = functools.partial(helpers.batchrun, real=True, text=True, timeout=900)


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """The sample file with each request's max_tokens removed, so `--max-tokens 12` bounds them:
    every request shape of the sample, at a fraction of its generation time."""
    tmp = tmp_path_factory.mktemp("chat")
    src = tmp / "chat.jsonl"
    lines = read(SAMPLES / "chat.jsonl")
    for line in lines:
        line["body"].pop("max_tokens", None)
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = batchrun("run", src, "-o", tmp / "out.jsonl", "--max-tokens", 12)
    return proc, lines, tmp


@pytest.fixture(scope="module")
def malformed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("malformed")
    proc = batchrun("run", SAMPLES / "malformed.jsonl", "-o", tmp / "out.jsonl",
                    "--errors", tmp / "errs.jsonl", "--metrics", tmp / "m.json", "--quiet")
    return proc, tmp


def test_sample_run_exits_zero_and_summarises(chat_run):
    proc, lines, tmp = chat_run
    assert proc.returncode == 0, proc.stderr
    assert "30 requests (30 ok, 0 failed)" in proc.stderr
    metrics = json.loads((tmp / "out.metrics.json").read_text())
    assert metrics["requests"] == {"total": 30, "ok": 30, "failed": 0}
    assert metrics["completion_tokens"] > 0 and metrics["ttft_s"]["p50"] > 0
    assert read(tmp / "out.errors.jsonl") == []


def test_every_output_line_is_an_openai_batch_line_with_a_chat_completion(chat_run):
    proc, lines, tmp = chat_run
    out = read(tmp / "out.jsonl")
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]
    for o in out:
        assert set(o) == BATCH_KEYS and error_of(o) is None
        assert o["id"].startswith("batch_req_")
        assert o["response"]["status_code"] == 200
        body = o["response"]["body"]
        completion = ChatCompletion.model_validate(body)
        assert completion.model == "smollm2-135m"
        assert completion.choices[0].message.role == "assistant"
        assert completion.choices[0].finish_reason in ("stop", "length")
        usage = completion.usage
        assert 1 <= usage.completion_tokens <= 12
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.prompt_tokens_details.cached_tokens is not None


def test_greedy_answer_is_the_real_model(chat_run):
    _, _, tmp = chat_run
    answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
               for o in read(tmp / "out.jsonl")}
    assert "Paris" in answers["capital-france"]


def test_malformed_file_gives_error_records_and_its_valid_lines_succeed(malformed_run):
    proc, tmp = malformed_run
    assert proc.returncode == 0, proc.stderr
    assert "req/s" not in proc.stderr and "requests (" not in proc.stderr  # --quiet
    out = read(tmp / "out.jsonl")
    assert [o["custom_id"] for o in out] == ["valid-1", "valid-2"]
    for o in out:
        ChatCompletion.model_validate(o["response"]["body"])
    errors = read(tmp / "errs.jsonl")
    assert all(set(e) == BATCH_KEYS for e in errors)
    by_line = {error_of(e)["line"]: e for e in errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8]
    assert error_of(by_line[2])["code"] == "invalid_json" and by_line[2]["response"] is None
    assert error_of(by_line[3])["message"] == "line 3: custom_id: field required"
    assert error_of(by_line[4])["message"] == "line 4: body.messages: field required"
    assert by_line[4]["custom_id"] == "no-messages"
    assert by_line[4]["response"]["status_code"] == 400
    assert "/v1/moderations" in error_of(by_line[5])["message"]
    assert error_of(by_line[6])["message"].startswith("line 6: body.temperature:")
    assert error_of(by_line[7])["message"].startswith("line 7: body.max_tokens:")
    assert error_of(by_line[8])["param"] == "stream"
    metrics = json.loads((tmp / "m.json").read_text())
    assert metrics["requests"] == {"total": 9, "ok": 2, "failed": 7}


def test_unknown_model_is_a_usage_error(tmp_path):
    proc = batchrun("run", SAMPLES / "chat.jsonl", "-o", tmp_path / "out.jsonl",
                    "--model", "no-such-model-anywhere")
    assert proc.returncode == 2
    assert "no-such-model-anywhere" in proc.stderr


def test_missing_input_and_bad_option_are_usage_errors(tmp_path):
    assert batchrun("run", tmp_path / "nope.jsonl", "-o", tmp_path / "o.jsonl").returncode == 2
    proc = batchrun("run", SAMPLES / "chat.jsonl", "-o", tmp_path / "o.jsonl",
                    "--kv-cache-memory", "lots")
    assert proc.returncode == 2 and "--kv-cache-memory" in proc.stderr
