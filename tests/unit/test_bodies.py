import pytest
from openai.types.chat import ChatCompletion

from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.openai.wire import LineError, RequestError
from batchrun.openai.bodies import (batch_error_line, batch_output_line, engine_error, line_error,
                                    new_request_id)
from batchrun.openai.serving import OpenAIServing
from batchrun.served_model import TokenizerModel
from tests.openai_batch_shape import check_line, error_of

BATCH_KEYS = {"id", "custom_id", "response", "error"}


def output(text="Paris.", tokens=(5, 6, 7), finish="stop", cached=4, error=None):
    return RequestOutput(request_id="req_1", prompt_token_ids=list(range(12)),
                         outputs=[CompletionOutput(0, text, list(tokens), finish)],
                         finished=True, num_cached_tokens=cached, error=error)


@pytest.fixture(scope="module")
def serving(smol_tokenizer):
    return OpenAIServing(TokenizerModel(smol_tokenizer, "smollm2-135m"))


def chat_body(serving, out, created=None):
    """The body the batch runner and the server write for `out`: the adapter's finalize."""
    prepared = serving.prepare("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "Capital of France?"}]})
    return prepared.finalize(out, created)


def test_chat_completion_is_openai_shaped(serving):
    body = chat_body(serving, output(), created=1700000000)
    parsed = ChatCompletion.model_validate(body)
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > 20
    assert body["object"] == "chat.completion" and body["created"] == 1700000000
    assert body["model"] == "smollm2-135m"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_length_finish_and_fresh_ids(serving):
    a = chat_body(serving, output(finish="length"))
    b = chat_body(serving, output())
    assert a["choices"][0]["finish_reason"] == "length"
    assert a["id"] != b["id"] and isinstance(a["created"], int)


def test_batch_output_line():
    rid = new_request_id()
    line = batch_output_line("task-3", rid, {"x": 1})
    check_line(line)
    assert set(line) == BATCH_KEYS
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "task-3"
    assert line["response"] == {"status_code": 200, "request_id": rid, "body": {"x": 1}}
    assert line["error"] is None


def test_error_line_with_custom_id_carries_the_api_answer_and_a_null_error():
    err = LineError(7, RequestError("body.messages: field required",
                                    code="missing_required_parameter", param="messages"), "t-7")
    line = batch_error_line(err)
    check_line(line)
    assert set(line) == BATCH_KEYS and line["custom_id"] == "t-7"
    assert line["response"]["status_code"] == 400
    assert line["response"]["request_id"].startswith("req_")
    # OpenAI sets `error` only for failures without an HTTP response; the line number and the
    # field are in the body's error.
    assert line["error"] is None
    assert line["response"]["body"] == {"error": {
        "message": "line 7: body.messages: field required", "type": "invalid_request_error",
        "param": "messages", "code": "missing_required_parameter"}}
    assert error_of(line)["line"] == 7 and line_error(line)["code"] == "missing_required_parameter"


def test_an_error_of_several_sources_names_the_file_in_the_body():
    err = LineError(2, RequestError("invalid JSON: x", code="invalid_json"), "c")
    line = batch_error_line(err, source="s3://b/in/2.jsonl")
    check_line(line)
    assert line["response"]["body"]["error"]["message"] == \
        "s3://b/in/2.jsonl: line 2: invalid JSON: x"
    assert error_of(line)["line"] == 2


def test_unparseable_line_has_null_custom_id_and_response():
    line = batch_error_line(LineError(3, RequestError("invalid JSON: x", code="invalid_json")))
    check_line(line)
    assert line["custom_id"] is None and line["response"] is None
    assert line["error"] == {"code": "invalid_json", "message": "line 3: invalid JSON: x",
                             "param": None, "line": 3}
    assert line_error(line) is line["error"]


def test_a_server_error_is_a_500_response_with_a_null_error():
    line = batch_error_line(engine_error(output(error="boom")), "c", "req_1")
    check_line(line)
    assert line["error"] is None and line["response"]["status_code"] == 500
    assert line_error(line)["code"] == "engine_error"


def test_line_error_reads_results_and_old_error_lines():
    assert line_error(batch_output_line("a", "req_1", {"x": 1})) is None
    old = {"id": "batch_req_1", "custom_id": "a", "error": {"code": "invalid_value",
           "message": "line 1: x", "param": "x", "line": 1},
           "response": {"status_code": 400, "request_id": "r", "body": {"error": {}}}}
    assert line_error(old)["code"] == "invalid_value"


def test_the_shape_check_refuses_what_openai_would_not_write():
    both = batch_error_line(LineError(4, RequestError("x", code="invalid_value"), "c"))
    both["error"] = {"code": "invalid_value", "message": "x", "param": None, "line": 4}
    with pytest.raises(AssertionError):
        check_line(both)
    neither = batch_output_line("c", "r", {})
    neither["response"] = None
    with pytest.raises(AssertionError):
        check_line(neither)


def test_engine_failure_and_abort_become_server_errors():
    err = engine_error(output(error="does not fit in the KV cache"))
    assert (err.status_code, err.type, err.code) == (500, "server_error", "engine_error")
    assert engine_error(output(finish="abort")).code == "aborted"
    assert engine_error(output()) is None
