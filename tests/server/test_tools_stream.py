"""Tool-call and reasoning chunks over HTTP: the scripted stand-in model (real engine, real
SmolLM2 tokenizer, a tools-capable template) answers with recorded text."""

import json

import openai
import pytest

from batchrun.openai.render import load_chat_template
from tests.scripted_model import script, scripted_model
from tests.server.conftest import serve

TEMPLATE = "batchrun/openai/templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants the weather. Call the tool.\n</think>\n\n"


@pytest.fixture(scope="module")
def tools_api(smol_tokenizer, tmp_path_factory):
    model = scripted_model(smol_tokenizer)
    with serve(model, tmp_path_factory.mktemp("tools"), chat_template=load_chat_template(TEMPLATE),
               reasoning_parser="qwen3") as running:
        yield running


def answer(api, body, text):
    """Script `text` as the model's answer to `body` (the prompt as the server renders it)."""
    prepared = api.state.serving.prepare("/v1/chat/completions", body)
    script(api.state.model, prepared.prompts[0], text)


def test_streamed_reasoning_then_tool_call(tools_api):
    body = {"model": "scripted", "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    answer(tools_api, body, THOUGHT + CALL)
    chunks = list(tools_api.client().chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **body))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    assert reasoning == "The user wants the weather. Call the tool."
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ""
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    assert json.loads(args) == {"city": "Paris"}
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_non_stream_tool_call_matches(tools_api):
    body = {"model": "scripted", "tools": [WEATHER],
            "messages": [{"role": "user", "content": "And in Rome?"}]}
    answer(tools_api, body, CALL.replace("Paris", "Rome"))
    r = tools_api.client().chat.completions.create(**body)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == {"city": "Rome"}


def test_tools_without_a_parser_are_a_400(real_model, tmp_path):
    # The bundled template does not render tools: the request is refused, never silently run.
    with serve(real_model, tmp_path) as srv:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client().chat.completions.create(
                model="smollm2-135m", tools=[WEATHER], max_tokens=4,
                messages=[{"role": "user", "content": "Weather in Paris?"}])
        assert e.value.body["param"] == "tools"


def responses_answer(api, body, text):
    prepared = api.state.serving.prepare("/v1/responses", body)
    script(api.state.model, prepared.prompts[0], text)


def test_responses_split_a_thought_into_a_reasoning_item(tools_api):
    from openai.types.responses import Response

    body = {"model": "scripted", "input": "Weather in Paris?"}
    responses_answer(tools_api, body, THOUGHT + "It is sunny in Paris.")
    response = tools_api.client().responses.create(**body)
    assert isinstance(response, Response) and response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    thought = response.output[0]
    assert thought.id.startswith("rs") and thought.status == "completed"
    assert [c.text for c in thought.content] == ["The user wants the weather. Call the tool."]
    assert response.output_text == "It is sunny in Paris."
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    assert response.usage.output_tokens > response.usage.output_tokens_details.reasoning_tokens


def test_streamed_responses_carry_the_reasoning_item_then_the_tool_call(tools_api):
    body = {"model": "scripted", "input": "Weather in Rome?",
            "tools": [{"type": "function", **WEATHER["function"]}]}
    responses_answer(tools_api, body, THOUGHT + CALL.replace("Paris", "Rome"))
    events = list(tools_api.client().responses.create(stream=True, **body))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "The user wants the weather. Call the tool."
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    # each item's events come between its added and done, in output order
    first_call = types.index("response.function_call_arguments.delta")
    assert types.index("response.reasoning_text.done") < first_call
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    call = final.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    assert final.output[0].content[0].text == reasoning
    assert final.usage.output_tokens_details.reasoning_tokens > 0
