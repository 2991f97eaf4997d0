"""/v1/responses on the real bundled model: the official client's responses.create (plain,
streamed, a forced tool call, a json_schema text format), batch files and the Batches API with
/v1/responses lines, and the 400s for what batchrun does not serve. Every Response body
validates as openai.types.responses.Response."""

import io
import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from batchrun.openai.render import load_chat_template
from tests.helpers import poll_batch
from tests.server.conftest import serve
from tests.openai_batch_shape import error_of

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TEMPLATE = "batchrun/openai/templates/chatml_tools.jinja"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def valid(body: dict) -> Response:
    """The body as OpenAI's own type, validated (not constructed) from the JSON we sent."""
    return Response.model_validate(body)


def line(custom_id, body, url="/v1/responses"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# --- batch files through the runner (before the server takes the engine) ----------------------

def test_a_batch_file_of_responses_lines(real_model, tmp_path):
    from batchrun.batch.job.plan import make_plan
    from batchrun.batch.job.runner import run_batch
    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.run import RunOptions

    src = write_jsonl(tmp_path / "in.jsonl", [
        line("plain", {"model": MODEL, "input": "What is the capital of France?",
                       "max_output_tokens": 16, "temperature": 0}),
        # greedy: a sampled name can run past 60 tokens and leave the JSON unfinished
        line("json", {"model": MODEL, "input": "A person as JSON.", "max_output_tokens": 60,
                      "temperature": 0, "text": {"format": {"type": "json_schema", "name": "person",
                                          "schema": PERSON, "strict": True}}}),
        line("bad", {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}),
        line("streamed", {"model": MODEL, "input": "hi", "stream": True}),
    ])
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    plan = make_plan(RunOptions(inputs=InputOptions(input=[str(src)]),
                                job=JobOptions(output=str(out), errors=str(err),
                                               progress="none")))
    summary = run_batch(real_model, plan)
    assert summary.requests.ok == 2 and summary.requests.failed == 2
    results = {r["custom_id"]: r for r in read_jsonl(out)}
    plain = valid(results["plain"]["response"]["body"])
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.output_text and plain.usage.output_tokens <= 16
    person = valid(results["json"]["response"]["body"])
    jsonschema.validate(json.loads(person.output_text), PERSON)
    errors = {r["custom_id"]: r for r in read_jsonl(err)}
    assert error_of(errors["bad"])["param"] == "tools.0.type"
    assert "web_search" in error_of(errors["bad"])["message"]
    assert error_of(errors["streamed"])["param"] == "stream"


def test_validate_checks_responses_lines_without_a_tokenizer():
    from types import SimpleNamespace

    from batchrun.batch.job.runner import check_line
    from batchrun.openai.wire import LineError
    from batchrun.options.openai import OpenAIOptions

    model = SimpleNamespace(name=MODEL, aliases=())
    raw = json.dumps(line("x", {"input": [{"type": "function_call_output", "output": "1"}]}))
    with pytest.raises(LineError) as e:
        check_line(raw, 3, model, OpenAIOptions())
    assert e.value.param == "input.0.call_id" and str(e.value).startswith("line 3: ")


# --- the HTTP API -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(real_model, tmp_path_factory):
    """The real model with a template that renders tools and the hermes parser."""
    with serve(real_model, tmp_path_factory.mktemp("responses"),
               chat_template=load_chat_template(TEMPLATE), tool_parser="hermes") as running:
        yield running


def create_raw(api, **body) -> dict:
    """The JSON body the server sent for client.responses.create(**body)."""
    raw = api.client().responses.with_raw_response.create(**body)
    return raw.http_response.json()


def test_plain_response(api):
    body = create_raw(api, model=MODEL, input="What is the capital of France?",
                      instructions="Answer in one short sentence.", max_output_tokens=24,
                      temperature=0, metadata={"run": "t1"}, user="u1", store=False)
    r = valid(body)
    assert r.status in ("completed", "incomplete") and r.model == MODEL
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.instructions == "Answer in one short sentence." and r.metadata == {"run": "t1"}
    assert r.temperature == 0 and r.user == "u1" and r.store is False
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 24
    assert u.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_an_incomplete_response(api):
    r = valid(create_raw(api, model=MODEL, input="Write a long story about a dragon.",
                         max_output_tokens=3))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_input_items_with_an_earlier_tool_call(api):
    """function_call / function_call_output items become the assistant's tool_calls and a tool
    message: the prompt renders them in the template's own tool format."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"}]
    prepared = api.state.serving.prepare("/v1/responses", {"input": items, "tools": [WEATHER]})
    prompt = api.state.model.tokenizer.decode(prepared.prompts[0])
    assert '<tool_call>' in prompt and '"city": "Paris"' in prompt and "18C, sunny" in prompt
    r = valid(create_raw(api, model=MODEL, input=items, tools=[WEATHER], tool_choice="none",
                         max_output_tokens=16))
    assert r.output[0].type == "message"


def test_streamed_response_events(api):
    events = list(api.client().responses.create(
        model=MODEL, input="Name three colors.", max_output_tokens=20, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    valid(final.model_dump(mode="json", exclude_unset=True))
    assert final.output_text == text and text
    assert final.usage.output_tokens > 0 and events[0].response.id == final.id


def test_stream_helper_gets_the_final_response(api):
    # (the helper has a final response only after response.completed, not .incomplete)
    with api.client().responses.stream(model=MODEL, input="What is 2+2?", temperature=0,
                                       max_output_tokens=200) as stream:
        events = list(stream)
        assert events[-1].type == "response.completed", [e.type for e in events][-3:]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas)


def test_forced_tool_call(api):
    body = create_raw(api, model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                      tool_choice={"type": "function", "name": "get_weather"},
                      max_output_tokens=60, temperature=0)
    r = valid(body)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"


def test_streamed_forced_tool_call(api):
    with api.client().responses.stream(
            model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        assert events[-1].type == "response.completed", [e.type for e in events]
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.done" in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.arguments == args and json.loads(args)["city"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and done.item_id == call.id


def test_json_schema_text_format(api):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = valid(create_raw(api, model=MODEL, input="Describe a person as JSON.",
                         text={"format": fmt}, max_output_tokens=60, temperature=0))
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    obj = valid(create_raw(api, model=MODEL, input="Any JSON object.",
                           text={"format": {"type": "json_object"}}, max_output_tokens=30))
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tools": [dict(WEATHER, name="bad name")]}, "tools.0.name"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # this model has no parser
])
def test_unsupported_or_bad_fields_are_a_400_naming_the_field(api, fields, param):
    body = {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        api.client().responses.create(**body)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"]


def test_another_model_is_a_404_naming_the_field(api):
    with pytest.raises(openai.NotFoundError) as e:
        api.client().responses.create(model="gpt-4o", input="hi")
    assert e.value.body["param"] == "model"


def test_the_batches_api_takes_responses_batches(api):
    client = api.client()
    lines = [line("a", {"model": MODEL, "input": "Hi", "max_output_tokens": 8}),
             line("b", {"model": MODEL, "input": "hi", "background": True})]
    f = client.files.create(file=("in.jsonl", io.BytesIO(
        "".join(json.dumps(x) + "\n" for x in lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                                  completion_window="24h")
    batch = poll_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 1 and batch.request_counts.failed == 1
    (ok,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert ok["custom_id"] == "a" and valid(ok["response"]["body"]).output_text
    usage = ok["response"]["body"]["usage"]
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (
        usage["input_tokens"], usage["output_tokens"])
    (bad,) = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert bad["custom_id"] == "b" and error_of(bad)["param"] == "background"
    # one batch, one endpoint: a chat line in a /v1/responses batch fails the batch
    mixed = [lines[0], line("c", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                            url="/v1/chat/completions")]
    f = client.files.create(file=("mixed.jsonl", io.BytesIO(
        "".join(json.dumps(x) + "\n" for x in mixed).encode())), purpose="batch")
    batch = poll_batch(client, client.batches.create(input_file_id=f.id,
                                                     endpoint="/v1/responses",
                                                     completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].line == 2
    assert batch.errors.data[0].code == "invalid_url"
    assert batch.usage.total_tokens == 0  # nothing ran
