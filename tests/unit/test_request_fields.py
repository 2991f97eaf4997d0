"""Each request field of the chat and completions endpoints: honoured (it reaches the prompt or
the engine's SamplingParams) or rejected with a 400 naming it. No engine needed."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from batchrun.openai.wire import RequestError
from batchrun.openai.render import load_chat_template
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.openai import OpenAIOptions
from batchrun.served_model import TokenizerModel

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOOLS_TEMPLATE = "batchrun/openai/templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def model(smol_tokenizer):
    return TokenizerModel(smol_tokenizer, "smollm2-135m",
                          aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",), max_model_len=2048)


@pytest.fixture(scope="module")
def chat(model):
    return OpenAIServing(model, ServingOptions.of(OpenAIOptions(chat_template=TOOLS_TEMPLATE)))


def body(**fields):
    return {"messages": [{"role": "user", "content": "Hi"}], **fields}


def params(serving, **fields):
    return serving.prepare(CHAT, body(**fields)).params


def rejected(serving, url=CHAT, payload=None, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        serving.prepare(url, payload if payload is not None else body(**fields),
                        allow_stream=False)
    assert info.value.status_code in (400, 404)
    return info.value


def prompt_text(serving, **fields):
    p = serving.prepare(CHAT, body(**fields))
    return serving.tokenizer.decode(p.prompts[0])


@pytest.mark.parametrize("name", ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", None])
def test_model_served_name_or_alias(chat, name):
    prepared = chat.prepare(CHAT, body(model=name))
    # The base model (no LoRA adapter), answered under its served name whatever alias was asked.
    assert prepared.kind == "chat" and prepared.params.lora is None
    assert prepared.formatter.model_name == "smollm2-135m"
    assert chat.tokenizer.decode(prepared.prompts[0]).rstrip().endswith("assistant")


def test_unknown_model_is_a_line_error(chat):
    err = rejected(chat, model="gpt-4o")
    assert (err.status_code, err.param, err.code) == (404, "model", "model_not_found")


def test_image_and_audio_parts_are_not_supported(chat):
    for part in ({"type": "image_url", "image_url": {"url": "data:,"}},
                 {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}):
        err = rejected(chat, payload={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, part]}]})
        assert err.param == "messages.0.content.1" and "not supported" in err.message


def test_sampling_fields_reach_the_engine(chat):
    p = params(chat, temperature=0.5, top_p=0.8, top_k=20, min_p=0.05, n=3, seed=7,
               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
               min_tokens=2, max_tokens=30, stop=["END", "\n\n"], stop_token_ids=[5],
               ignore_eos=True, logit_bias={"42": 5.0, "7": -100})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.n, p.seed) == (0.5, 0.8, 20, 0.05, 3, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_tokens, p.max_tokens, p.stop, p.stop_token_ids) == (2, 30, ["END", "\n\n"], [5])
    assert p.ignore_eos and p.logit_bias == {42: 5.0, 7: -100}
    assert params(chat, stop="END").stop == ["END"]


def test_max_completion_tokens_and_logprobs(chat):
    assert params(chat, max_tokens=50, max_completion_tokens=5).max_tokens == 5
    assert params(chat, logprobs=True).logprobs == 0
    assert params(chat, logprobs=True, top_logprobs=5).logprobs == 5
    assert params(chat).logprobs is None


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"n": 0}, "n"), ({"n": 129}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"top_logprobs": 21, "logprobs": True},
                                                       "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stop_token_ids": [10 ** 7]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"), ({"max_completion_tokens": 0},
                                                          "max_completion_tokens"),
    ({"max_tokens": 5000}, "max_tokens"), ({"seed": 1.5}, "seed"), ({"stream": True}, "stream"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}}, "response_format.json_schema.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"metadata": {"k": 1}}, "metadata.k"), ({"user": 5}, "user"), ({"echo": "yes"}, "echo"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_values_are_a_400_naming_the_field(chat, fields, param):
    err = rejected(chat, **fields)
    assert err.param == param, err.message


def test_response_format_becomes_a_grammar(chat):
    assert params(chat, response_format={"type": "text"}).grammar is None
    assert params(chat, response_format={"type": "json_object"}).grammar.json_schema == {
        "type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = params(chat, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema, "strict": True}}).grammar
    assert g.json_schema == schema


def test_tools_reach_the_template_and_choices_set_grammars(chat):
    assert "get_weather" in prompt_text(chat, tools=[WEATHER])
    assert params(chat, tools=[WEATHER]).grammar is None  # auto: the model decides
    assert params(chat, tools=[WEATHER], tool_choice="auto").grammar is None
    assert "get_weather" not in prompt_text(chat, tools=[WEATHER], tool_choice="none")
    required = params(chat, tools=[WEATHER], tool_choice="required").grammar.lark
    assert '("\\n" call)*' in required
    single = params(chat, tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False).grammar.lark
    assert "call)*" not in single
    named = params(chat, tools=[WEATHER], tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}})
    assert "get_weather" in named.grammar.lark


def test_tools_without_a_template_that_renders_them_name_chat_template(model):
    err = rejected(OpenAIServing(model, ServingOptions(OpenAIOptions(tool_parser="hermes"))), tools=[WEATHER])
    assert err.param == "tools" and "--chat-template" in err.message


def test_chat_template_kwargs_reach_the_template(chat):
    assert prompt_text(chat).endswith("<|im_start|>assistant\n")
    assert prompt_text(chat, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_generation_prompt_and_continuing_the_final_message(chat):
    assert not prompt_text(chat, add_generation_prompt=False).endswith("assistant\n")
    p = chat.prepare(CHAT, {"messages": [{"role": "user", "content": "Hi"},
                                         {"role": "assistant", "content": "Hello, I am"}],
                            "add_generation_prompt": False, "continue_final_message": True})
    assert chat.tokenizer.decode(p.prompts[0]).endswith("<|im_start|>assistant\nHello, I am")


def test_user_and_metadata_are_accepted_and_carried(chat):
    p = chat.prepare(CHAT, body(user="u-1", metadata={"team": "eval"}))
    assert p.request.user == "u-1" and p.request.metadata == {"team": "eval"}


def test_unknown_fields_are_accepted_and_logged_once(chat, caplog):
    caplog.set_level(logging.WARNING, logger="batchrun.openai.requests")
    for _ in range(3):
        chat.prepare(CHAT, body(store=True, zz_new_openai_field={"a": 1}))
    assert sum("zz_new_openai_field" in r.message for r in caplog.records) == 1


# --- /v1/completions ---------------------------------------------------------------------------

def test_completion_prompt_forms(chat):
    tok = chat.tokenizer
    assert chat.prepare(COMPLETIONS, {"prompt": "Hello"}).prompts == [tok("Hello")["input_ids"]]
    assert len(chat.prepare(COMPLETIONS, {"prompt": ["a", "b", "c"]}).prompts) == 3
    assert chat.prepare(COMPLETIONS, {"prompt": [5, 6, 7]}).prompts == [[5, 6, 7]]
    assert chat.prepare(COMPLETIONS, {"prompt": [[5, 6], [7]]}).prompts == [[5, 6], [7]]
    p = chat.prepare(COMPLETIONS, {"prompt": "Hi", "logprobs": 3, "n": 2})
    assert (p.params.max_tokens, p.params.logprobs, p.params.n) == (16, 3, 2)


@pytest.mark.parametrize("fields, param", [
    ({"echo": True, "suffix": "end"}, "suffix"), ({"suffix": "end"}, "suffix"),
    ({"logprobs": 6}, "logprobs"), ({"echo": True, "logprobs": 6}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"echo": True, "stream": True}, "echo"), ({"prompt_logprobs": 1, "stream": True},
                                               "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": [1, "a"]}, "prompt.0"),
    ({"prompt": [10 ** 7]}, "prompt"), ({"best_of": 3}, "best_of"), ({"stream": True}, "stream"),
])
def test_completion_rejections(chat, fields, param):
    payload = {"prompt": "Hi", **fields}
    assert rejected(chat, COMPLETIONS, payload).param == param


def test_structured_output_needs_a_tokenizer_llguidance_reads(model):
    class Slow:  # not a fast tokenizer
        chat_template = None
        eos_token_id = 2

        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False,
                                return_dict=False, **kwargs):
            return {"input_ids": [1, 2, 3]} if tokenize else "x"

    slow = OpenAIServing(dataclasses.replace(model, tokenizer=Slow()))
    err = rejected(slow, response_format={"type": "json_object"})
    assert err.param == "response_format" and "not available" in err.message
    slow.prepare(CHAT, body())  # everything else still works
