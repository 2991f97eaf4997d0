import json
import logging

import pytest

from batchrun.openai.wire import LineError, parse_batch_line
from batchrun.openai.requests import ChatCompletionRequest


def line(body=None, **envelope):
    obj = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
           "body": body if body is not None else {"messages": [{"role": "user", "content": "Hi"}]}}
    obj.update(envelope)
    return json.dumps(obj)


def body(**fields):
    return {"messages": [{"role": "user", "content": "Hi"}], **fields}


def error_of(raw, number=7):
    with pytest.raises(LineError) as info:
        parse_batch_line(raw, number)
    return info.value


def test_valid_line_parses():
    envelope, request = parse_batch_line(line(body(temperature=0, max_tokens=16, seed=3,
                                                   stop=["\n"])), 1)
    assert envelope.custom_id == "req-1"
    assert request.temperature == 0 and request.max_tokens == 16 and request.stop == ["\n"]
    assert request.messages[0].content == "Hi"


def test_invalid_json_names_line_and_has_no_custom_id():
    err = error_of('{"custom_id": "a", "body": ', 3)
    assert err.code == "invalid_json"
    assert str(err).startswith("line 3: invalid JSON")
    assert err.custom_id is None


def test_non_object_line():
    assert error_of("[1, 2]").code == "invalid_json"


def test_missing_custom_id():
    obj = json.loads(line())
    del obj["custom_id"]
    err = error_of(json.dumps(obj))
    assert str(err) == "line 7: custom_id: field required"
    assert err.code == "missing_required_parameter" and err.custom_id is None


def test_missing_messages_names_the_field():
    err = error_of(line({"model": "x"}))
    assert str(err) == "line 7: body.messages: field required"
    assert err.custom_id == "req-1" and err.param == "messages"


@pytest.mark.parametrize("url", ["/v1/moderations"])
def test_known_but_unsupported_endpoints(url):
    err = error_of(line(url=url))
    assert err.code == "unsupported_endpoint" and err.param == "url"
    assert f"the endpoint {url} is not supported" in str(err)


def test_unknown_url():
    err = error_of(line(url="/v2/chat"))
    assert err.code == "invalid_url" and "/v2/chat" in str(err) and err.param == "url"


def test_method_must_be_post():
    assert "method" in str(error_of(line(method="GET")))


@pytest.mark.parametrize("fields, param, code", [
    ({"temperature": 5}, "temperature", "invalid_value"),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"max_tokens": "100"}, "max_tokens", "invalid_type"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens", "invalid_type"),
    ({"n": 0}, "n", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [1]}, "stop.0", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"seed": "1"}, "seed", "invalid_type"),
])
def test_invalid_values_name_the_field(fields, param, code):
    err = error_of(line(body(**fields)))
    assert err.param == param and err.code == code
    assert str(err).startswith(f"line 7: body.{param}: ")


def test_bad_messages():
    assert error_of(line({"messages": []})).param == "messages"
    err = error_of(line({"messages": [{"role": "robot", "content": "x"}]}))
    assert err.param == "messages.0.role"
    err = error_of(line({"messages": [{"role": "user", "content": 5}]}))
    assert "content must be a string or an array of content parts" in str(err)
    err = error_of(line({"messages": [{"role": "user", "content": [{"type": "text"}]}]}))
    assert err.param == "messages.0.content.0" and "'text'" in str(err)


def test_text_parts_and_other_parts_parse():
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    parts = request.messages[0].content
    assert [p.type for p in parts] == ["text", "image_url"]


def test_assistant_turn_with_tool_calls_and_extra_fields():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]})
    assert request.messages[1].tool_calls[0]["id"] == "c1"


def test_unknown_fields_are_kept_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="batchrun.openai.wire")
    for _ in range(3):
        request = ChatCompletionRequest.model_validate(body(zz_unknown_option=1))
    assert request.model_extra == {"zz_unknown_option": 1}
    assert sum("zz_unknown_option" in r.message for r in caplog.records) == 1
