"""GPT-OSS's Harmony output through the chat path: a tiny gpt_oss checkpoint folder (config and
generation_config as GPT-OSS ships them) served by the scripted stand-in model on the real engine,
with the bundled tokenizer plus Harmony's special tokens. Bodies validated by the `openai`
package's types."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from batchrun.llm import read_generation_config
from batchrun.openai.render import to_template_messages
from batchrun.openai.requests import ChatMessage
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.openai.structured import special_literal
from tests.harmony_tokenizer import eos_ids, harmony_tokenizer
from tests.scripted_model import scripted_model
from tests.unit.test_harmony_parser import CALL, FINAL, PREAMBLE, THOUGHT
from tests.unit.test_serving import TIME, WEATHER, body, finalize, run, stream

CHAT = "/v1/chat/completions"
AFTER = " and then more text the turn must not reach"  # scripted past the end of the turn


@pytest.fixture(scope="module")
def model(smol_tokenizer, tmp_path_factory):
    from tests.tiny_models import BACKEND_ARCHS, tiny_config

    tokenizer = harmony_tokenizer(smol_tokenizer)
    folder = tmp_path_factory.mktemp("gpt-oss")
    tiny_config("gpt_oss", BACKEND_ARCHS, vocab_size=len(tokenizer)).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids(tokenizer)}))
    return scripted_model(tokenizer, "gpt-oss", eos=read_generation_config(folder)[1], path=folder)


@pytest.fixture(scope="module")
def serving(model):
    return OpenAIServing(model, ServingOptions())


def test_picked_by_the_checkpoints_model_type(model, serving):
    assert serving.tool_parser.name == "harmony"
    # without the template's markers, config.json's model_type still picks it
    assert OpenAIServing(model, ServingOptions(chat_template="{{ messages }}")).tool_parser.name \
        == "harmony"


def test_thought_and_answer_stop_at_return(model, serving):
    p = serving.prepare(CHAT, body(reasoning_effort="high"))
    assert "Reasoning: high" in model.tokenizer.decode(p.prompts[0])
    assert p.params.skip_special_tokens is False
    result = finalize(model, p, FINAL + AFTER)
    choice = result["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny in Paris.",
                                 "reasoning_content": "User asks the weather. Use the tool."}
    assert choice["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == len(model.tokenizer.encode(FINAL))
    thought = len(model.tokenizer.encode(THOUGHT.removesuffix("<|start|>assistant")))
    assert result["usage"]["completion_tokens_details"]["reasoning_tokens"] == thought


def test_preamble_and_call_stop_at_call(model, serving):
    result = finalize(model, serving.prepare(CHAT, body(tools=[WEATHER])),
                      THOUGHT + PREAMBLE + CALL + AFTER)
    ChatCompletion.model_validate(result)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look that up."
    assert choice["message"]["reasoning_content"] == "User asks the weather. Use the tool."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_stream_sends_the_same_as_deltas(model, serving):
    """The same answer as test_preamble_and_call_stop_at_call's, streamed."""
    text = THOUGHT + PREAMBLE + CALL
    chunks = stream(model, serving.prepare(CHAT, body(tools=[WEATHER], stream=True, stream_options={
        "include_usage": True})), text + AFTER)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    joined = {field: "".join(d["delta"].get(field) or "" for d in deltas)
              for field in ("content", "reasoning_content")}
    assert joined == {"content": "Let me look that up.",
                      "reasoning_content": "User asks the weather. Use the tool."}
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(t["function"].get("arguments", "") for t in calls) == '{"city": "Paris"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(model.tokenizer.encode(text))
    thought = len(model.tokenizer.encode(THOUGHT.removesuffix("<|start|>assistant")))
    assert usage["completion_tokens_details"]["reasoning_tokens"] == thought


def test_a_turn_cut_by_max_tokens_keeps_what_it_has(model, serving):
    choice = finalize(model, serving.prepare(CHAT, body(max_tokens=6)), FINAL)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] and \
        "User asks the weather".startswith(choice["message"]["reasoning_content"])


def test_required_tool_choice_is_forced_in_harmony(model, serving):
    """The call grammar (its sentences: test_harmony_parser.py) is what the engine runs under."""
    p = serving.prepare(CHAT, body(tools=[WEATHER], tool_choice="required"))
    assert p.params.grammar.lark == serving.tool_parser.grammar(
        [WEATHER], True, special_literal(model.tokenizer))


def test_response_format_is_held_in_the_final_channel(model, serving):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p = serving.prepare(CHAT, body(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema}}))
    answer = THOUGHT + '<|channel|>final<|message|>{"a": 1}<|return|>'
    message = finalize(model, p, answer)["choices"][0]["message"]
    assert message["content"] == '{"a": 1}'  # the grammar let the thought and channel through
    assert message["reasoning_content"] == "User asks the weather. Use the tool."


def test_responses_reasoning_effort_reaches_the_template(model, serving):
    p = serving.prepare("/v1/responses", {"model": "gpt-oss", "input": "Weather in Paris?",
                                          "reasoning": {"effort": "low"}})
    assert "Reasoning: low" in model.tokenizer.decode(p.prompts[0])
    out = run(model, p, FINAL)[-1]
    items = p.finalize(out)["output"]
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "User asks the weather. Use the tool."
    assert items[1]["content"][0]["text"] == "It is sunny in Paris."


# Earlier turns: what the client sends back (OpenAI's shape) must reach GPT-OSS's template in the
# shape it reads, which the template's own rendering of that shape is the reference for.
PLAN = "User asks the weather. Use the tool."
USER = {"role": "user", "content": "Weather in Paris?"}


def _call(name, args, id_):
    return {"id": id_, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _history_prompt(model, serving, messages, **fields):
    text = model.tokenizer.decode(serving.prepare(CHAT, {"messages": messages, **fields})
                                  .prompts[0], skip_special_tokens=False)
    assert text.endswith("<|start|>assistant")
    return text


def _template(model, messages, **fields):
    """The template's rendering of messages already in its shape (calls' arguments as objects)."""
    return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False, **fields)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])  # vLLM's names for it
def test_a_calls_thought_reaches_the_template_as_thinking(model, serving, field):
    call = _call("get_weather", {"city": "Paris"}, "call_1")
    messages = [USER, {"role": "assistant", "content": None, field: PLAN, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = _history_prompt(model, serving, messages, tools=[WEATHER])
    # the field the template reads is set here: transformers 5.24 copies reasoning_content into
    # `thinking` itself, 5.20 (the oldest batchrun takes) passes messages on as they are
    shaped = to_template_messages([ChatMessage.model_validate(m) for m in messages],
                                  model.tokenizer)
    assert shaped[1]["thinking"] == PLAN and "reasoning_content" not in shaped[1]
    assert text == _template(model, [USER, {
        "role": "assistant", "content": "", "thinking": PLAN, "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        messages[2]], tools=[WEATHER])
    assert text.endswith(
        f"<|start|>assistant<|channel|>analysis<|message|>{PLAN}<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
        '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>'
        'commentary<|message|>"sunny"<|end|><|start|>assistant')


def test_our_own_answer_sent_back_keeps_its_thought_not_its_preamble(model, serving):
    """test_preamble_and_call_stop_at_call's message as a client sends it back: a thought, a
    preamble and a call in one turn, which the template refuses as they are."""
    answer = finalize(model, serving.prepare(CHAT, body(tools=[WEATHER])),
                      THOUGHT + PREAMBLE + CALL)["choices"][0]["message"]
    call_id = answer["tool_calls"][0]["id"]
    messages = [USER, answer, {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    text = _history_prompt(model, serving, messages, tools=[WEATHER])
    assert f"<|channel|>analysis<|message|>{PLAN}<|end|>" in text
    assert "Let me look that up." not in text
    with pytest.raises(Exception, match="both content and thinking"):
        _template(model, [USER, {**answer, "thinking": PLAN}, messages[2]], tools=[WEATHER])


def test_thoughts_before_a_final_answer_are_left_out(model, serving):
    call = _call("get_weather", {"city": "Paris"}, "call_1")
    messages = [USER, {"role": "assistant", "reasoning_content": PLAN, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny in Paris.",
                 "reasoning_content": "The tool says sunny."},
                {"role": "user", "content": "And tomorrow?"}]
    text = _history_prompt(model, serving, messages, tools=[WEATHER])
    assert PLAN not in text and "The tool says sunny." not in text
    assert "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|end|>" in text


def test_two_calls_in_one_turn_become_two_turns_each_answered_by_its_result(model, serving):
    """The template writes one call per turn and addresses a result from the latest call: the
    results, sent in the other order, must each follow their own call."""
    weather = _call("get_weather", {"city": "Paris"}, "call_w")
    time = _call("get_time", {}, "call_t")
    results = [{"role": "tool", "tool_call_id": "call_t", "content": "noon"},
               {"role": "tool", "tool_call_id": "call_w", "content": "sunny"}]
    text = _history_prompt(model, serving, [
        USER, {"role": "assistant", "reasoning_content": PLAN, "tool_calls": [weather, time]},
        *results], tools=[WEATHER, TIME])

    def as_template_reads(call):
        return [{**call, "function": {**call["function"],
                                      "arguments": json.loads(call["function"]["arguments"])}}]
    assert text == _template(model, [
        USER, {"role": "assistant", "content": "", "thinking": PLAN,
               "tool_calls": as_template_reads(weather)}, results[1],
        {"role": "assistant", "content": "", "tool_calls": as_template_reads(time)}, results[0]],
        tools=[WEATHER, TIME])
    assert ('to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '"sunny"<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json'
            '<|message|>{}<|call|><|start|>functions.get_time to=assistant<|channel|>commentary'
            '<|message|>"noon"<|end|>') in text


def test_continuing_a_final_answer_writes_its_thought_first(model, serving):
    """continue_final_message: the template writes the last turn's thought (only there), then
    the answer to be continued."""
    p = serving.prepare(CHAT, {"messages": [USER, {
        "role": "assistant", "content": "It is", "reasoning_content": PLAN}],
        "add_generation_prompt": False, "continue_final_message": True})
    text = model.tokenizer.decode(p.prompts[0], skip_special_tokens=False)
    assert text.endswith(f"<|start|>assistant<|channel|>analysis<|message|>{PLAN}<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>It is")



def test_responses_reasoning_items_are_the_thought_of_the_turn_they_precede(model, serving):
    """/v1/responses input: a reasoning item (as batchrun's responses write it) before a
    function_call is that call turn's reasoning_content: the same prompt as the chat request."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": PLAN}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    tool = {"type": "function", **WEATHER["function"]}
    responses = serving.prepare("/v1/responses", {"model": "gpt-oss", "input": items,
                                                  "tools": [tool]}).prompts[0]
    chat = serving.prepare(CHAT, {"tools": [WEATHER], "messages": [
        USER, {"role": "assistant", "reasoning_content": PLAN,
               "tool_calls": [_call("get_weather", {"city": "Paris"}, "call_1")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}).prompts[0]
    assert responses == chat
    assert f"<|channel|>analysis<|message|>{PLAN}<|end|>" in \
        model.tokenizer.decode(responses, skip_special_tokens=False)
