"""OpenAIServing end to end through the real engine with a scripted model: tools, reasoning,
n > 1, streaming, echo; every body validated by the `openai` package's types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from batchrun.openai.wire import RequestError
from batchrun.openai.render import load_chat_template
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.openai import OpenAIOptions
from tests.scripted_model import script, scripted_model

CHAT = "/v1/chat/completions"
TEMPLATE = "batchrun/openai/templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model(smol_tokenizer):
    return scripted_model(smol_tokenizer)


def serving(model, **options):
    options.setdefault("chat_template", load_chat_template(TEMPLATE))
    return OpenAIServing(model, ServingOptions.of(OpenAIOptions(**options)))


def body(content="What is the weather in Paris?", **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


def run(model, prepared, text, stream=False):
    """Script the answer, run it through the engine; returns the outputs (and stream chunks)."""
    script(model, prepared.prompts[0], text)
    engine = model.engine
    engine.add_request("r", prepared.prompts[0], prepared.params, stream=stream)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def finalize(model, prepared, text) -> dict:
    out = run(model, prepared, text)[-1]
    result = prepared.finalize(out)
    ChatCompletion.model_validate(result)
    return result


def stream(model, prepared, text) -> list[dict]:
    chunks_state = prepared.chunks()
    chunks = chunks_state.start()
    for out in run(model, prepared, text, stream=True):
        chunks += chunks_state.update(out)
    chunks += chunks_state.end()
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return chunks


def test_auto_tool_call_is_parsed_into_tool_calls(model):
    p = serving(model).prepare(CHAT, body(tools=[WEATHER, TIME]))
    assert "get_weather" in model.tokenizer.decode(p.prompts[0])  # the template shows the tools
    result = finalize(model, p, "Let me look that up.\n" + CALL)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look that up."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert result["system_fingerprint"].startswith("fp_")


def test_plain_answer_with_tools_has_no_tool_calls(model):
    p = serving(model).prepare(CHAT, body(tools=[WEATHER]))
    choice = finalize(model, p, "It is sunny.")["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "It is sunny."
    assert "tool_calls" not in choice["message"]


def test_named_tool_choice_finishes_with_stop_and_required_with_tool_calls(model):
    s = serving(model)
    named = s.prepare(CHAT, body(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert named.params.grammar is not None and "get_time" not in named.params.grammar.lark
    assert finalize(model, named, CALL)["choices"][0]["finish_reason"] == "stop"
    required = s.prepare(CHAT, body(tools=[WEATHER, TIME], tool_choice="required"))
    assert "get_time" in required.params.grammar.lark
    assert finalize(model, required, CALL)["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(model):
    p = serving(model).prepare(CHAT, body(tools=[WEATHER], parallel_tool_calls=False))
    calls = finalize(model, p, CALL + "\n" + CALL.replace("Paris", "Rome"))["choices"][0][
        "message"]["tool_calls"]
    assert len(calls) == 1 and "Paris" in calls[0]["function"]["arguments"]


def test_tool_choice_none_hides_the_tools(model):
    p = serving(model).prepare(CHAT, body(tools=[WEATHER], tool_choice="none"))
    assert "get_weather" not in model.tokenizer.decode(p.prompts[0])
    assert "tool_calls" not in finalize(model, p, CALL)["choices"][0]["message"]


def test_template_that_ignores_tools_is_a_400_naming_chat_template(model):
    s = OpenAIServing(model, ServingOptions(OpenAIOptions(tool_parser="hermes")))  # SmolLM2's own template
    with pytest.raises(RequestError) as info:
        s.prepare(CHAT, body(tools=[WEATHER]))
    assert info.value.param == "tools" and "--chat-template" in info.value.message
    assert info.value.status_code == 400


def test_reasoning_is_split_and_counted(model):
    p = serving(model, reasoning_parser="qwen3").prepare(CHAT, body("Hi"))
    text = "<think>\nThe user says hi. Greet back.\n</think>\n\nHello there!"
    result = finalize(model, p, text)
    message = result["choices"][0]["message"]
    assert message["reasoning_content"] == "The user says hi. Greet back."
    assert message["content"] == "Hello there!"
    details = result["usage"]["completion_tokens_details"]
    thought = model.tokenizer.encode("<think>\nThe user says hi. Greet back.\n</think>")
    assert details["reasoning_tokens"] == len(thought)
    assert result["usage"]["completion_tokens"] == len(model.tokenizer.encode(text)) + 1  # + EOS


def test_n_choices_each_parse_their_own_calls_and_usage_counts_all(model):
    p = serving(model).prepare(CHAT, body(tools=[WEATHER], n=3))
    result = finalize(model, p, CALL)
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    ids = {c["message"]["tool_calls"][0]["id"] for c in result["choices"]}
    assert len(ids) == 3
    per_choice = len(model.tokenizer.encode(CALL)) + 1
    assert result["usage"]["completion_tokens"] == 3 * per_choice


def test_stream_concatenates_to_the_whole_response(model):
    s = serving(model, reasoning_parser="qwen3")
    text = "<think>\nCheck the weather.\n</think>\n\n" + CALL
    p = s.prepare(CHAT, body(tools=[WEATHER], n=2, stream=True, logprobs=True, top_logprobs=2,
                             stream_options={"include_usage": True}))
    chunks = stream(model, p, text)
    whole = finalize(model, s.prepare(CHAT, body(tools=[WEATHER], logprobs=True,
                                                 top_logprobs=2)), text)["choices"][0]
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
        assert reasoning == whole["message"]["reasoning_content"]
        calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather"
        args = "".join(t["function"].get("arguments", "") for t in calls)
        assert args == whole["message"]["tool_calls"][0]["function"]["arguments"]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        streamed_lp = [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]]
        assert [e["token"] for e in streamed_lp] == [e["token"] for e in whole["logprobs"]["content"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_echo_repeats_the_continued_assistant_message(model):
    s = serving(model)
    p = s.prepare(CHAT, {"messages": [{"role": "user", "content": "Count"},
                                      {"role": "assistant", "content": "One, two,"}],
                         "continue_final_message": True, "add_generation_prompt": False,
                         "echo": True})
    assert model.tokenizer.decode(p.prompts[0]).endswith("One, two,")
    assert finalize(model, p, " three.")["choices"][0]["message"]["content"] == "One, two, three."


def test_completions_with_several_prompts_and_n(model):
    s = serving(model)
    p = s.prepare("/v1/completions", {"prompt": ["Once upon", "In a galaxy far"], "n": 2,
                                      "max_tokens": 8, "logprobs": 2})
    assert len(p.prompts) == 2 and p.params.n == 2 and p.params.logprobs == 2
    outs = []
    for k, prompt in enumerate(p.prompts):
        script(model, prompt, [" a time", " away"][k])
        outs.append(model.engine.generate([prompt], p.params)[0])
    result = p.finalize(outs)
    Completion.model_validate(result)
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in result["choices"]] == [" a time", " a time", " away", " away"]
    lp = result["choices"][0]["logprobs"]
    assert lp["tokens"] == [" a", " time", "<|im_end|>"] and lp["text_offset"][0] == 0
    assert len(lp["top_logprobs"][0]) <= 2
    assert result["usage"]["prompt_tokens"] == sum(len(x) for x in p.prompts)


def test_mistral_calls_keep_special_tokens_but_not_the_final_eos(model):
    s = serving(model, tool_parser="mistral")
    p = s.prepare(CHAT, body(tools=[WEATHER]))
    assert p.params.skip_special_tokens is False
    call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    choice = finalize(model, p, call)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert len(choice["message"]["tool_calls"][0]["id"]) == 9
    plain = finalize(model, s.prepare(CHAT, body(tools=[WEATHER])), "No tool needed.")
    assert plain["choices"][0]["message"]["content"] == "No tool needed."


@pytest.mark.parametrize("tools", [False, True])
def test_constraints_start_after_the_thought(model, tools):
    """With a reasoning parser, the grammar leaves `<think>…</think>` free and holds the answer."""
    s = serving(model, reasoning_parser="qwen3")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    if tools:
        fields = {"tools": [WEATHER], "tool_choice": "required"}
        answer = CALL
    else:
        fields = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}}}
        answer = '{"a": 1}'
    p = s.prepare(CHAT, body(**fields))
    message = finalize(model, p, "<think>\nFirst, {a guess}.\n</think>\n\n" + answer)[
        "choices"][0]["message"]
    assert message["reasoning_content"] == "First, {a guess}."
    if tools:
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert message["content"] == '{"a": 1}'
    # without a thought the answer is held to the grammar from the first token
    no_thought = finalize(model, s.prepare(CHAT, body(**fields)), answer)["choices"][0]
    assert no_thought["message"]["reasoning_content"] is None


def test_grammar_holds_when_the_model_wanders_after_the_thought(model):
    s = serving(model, reasoning_parser="qwen3")
    p = s.prepare(CHAT, body(response_format={"type": "json_object"}, max_tokens=40,
                             temperature=0))
    result = finalize(model, p, "<think>\nok\n</think>\n\nNot JSON at all, sorry.")
    assert result["choices"][0]["message"]["content"].startswith('{"')  # not "Not"


def test_completions_stream_chunks(model):
    p = serving(model).prepare("/v1/completions", {"prompt": "Once upon", "max_tokens": 8,
                                                   "logprobs": 1, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    state = p.chunks()
    chunks = state.start()
    for out in run(model, p, " a time there was"):
        chunks += state.update(out)
    chunks += state.end()
    for c in chunks:
        Completion.model_validate(c)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == " a time there was"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert "".join(tokens).startswith(" a time there was")
    assert chunks[-1]["usage"]["completion_tokens"] == len(tokens)
