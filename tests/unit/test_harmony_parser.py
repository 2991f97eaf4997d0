"""GPT-OSS's Harmony output read into reasoning, content and tool calls: whole, token by token
through the chat path's ChoiceParser, and against the grammar that forces a call."""

from __future__ import annotations

import json

import pytest

from batchrun.openai.chat import ChoiceParser
from batchrun.openai.parsers import detect_tool_parser, tool_parser
from tests.harmony_tokenizer import harmony_tokenizer

THOUGHT = ("<|channel|>analysis<|message|>User asks the weather. Use the tool.<|end|>"
           "<|start|>assistant")
CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
FINAL = THOUGHT + "<|channel|>final<|message|>It is sunny in Paris.<|return|>"
PREAMBLE = "<|channel|>commentary<|message|>Let me look that up.<|end|><|start|>assistant"
# The recipient may also sit in the role part of the header, before the channel.
ROLE_RECIPIENT = (' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
                  '{"city": "Rome"}<|call|>')

CASES = {  # text: (reasoning, content, calls)
    "final only": ("<|channel|>final<|message|>Hello!<|return|>", (None, "Hello!", [])),
    "analysis and final": (FINAL, ("User asks the weather. Use the tool.",
                                   "It is sunny in Paris.", [])),
    "tool call": (THOUGHT + CALL, ("User asks the weather. Use the tool.", None,
                                   [("get_weather", {"city": "Paris"})])),
    "preamble then call": (THOUGHT + PREAMBLE + CALL, (
        "User asks the weather. Use the tool.", "Let me look that up.",
        [("get_weather", {"city": "Paris"})])),
    "recipient in the role": (ROLE_RECIPIENT, (None, None, [("get_weather", {"city": "Rome"})])),
    "truncated thought": ("<|channel|>analysis<|message|>Let me think about", (
        "Let me think about", None, [])),
    "truncated answer": (THOUGHT + "<|channel|>final<|message|>It is sun", (
        "User asks the weather. Use the tool.", "It is sun", [])),
    "not harmony": ("Plain text from a model off its format.", (
        None, "Plain text from a model off its format.", [])),
}


def whole(text):
    parsed = tool_parser("harmony").parse_text(text, partial=False)
    return parsed.reasoning, parsed.content, [(n, json.loads(a)) for n, a in parsed.calls]


@pytest.mark.parametrize("case", CASES)
def test_channels_become_reasoning_content_and_calls(case):
    text, expected = CASES[case]
    assert whole(text) == expected


def test_a_call_cut_off_keeps_what_it_has():
    parsed = tool_parser("harmony").parse_text(THOUGHT + CALL[:-len('"}<|call|>')], False)
    assert parsed.calls == [("get_weather", '{"city": "Paris')]


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    return harmony_tokenizer(smol_tokenizer)


@pytest.mark.parametrize("case", CASES)
def test_token_by_token_stream_equals_whole_parse(tokenizer, case):
    text, expected = CASES[case]
    ids = tokenizer.encode(text)
    parser = ChoiceParser(None, tool_parser("harmony"))
    deltas, sent = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k], skip_special_tokens=False)
        deltas.append(parser.feed(now[len(sent):]))
        sent = now
    deltas.append(parser.finish())
    reasoning = "".join(d.reasoning for d in deltas) or None
    content = "".join(d.content for d in deltas) or None
    names = [t.name for d in deltas for t in d.tool_calls if t.name]
    args = "".join(t.arguments or "" for d in deltas for t in d.tool_calls)
    calls = [(names[0], json.loads(args))] if names else []
    assert (reasoning, content, calls) == expected
    assert not any("<|" in (d.content + d.reasoning) for d in deltas) or case == "not harmony"
    # no marker text, and the thought streams before anything else
    kinds = ["r" if d.reasoning else "o" for d in deltas if d]
    assert kinds == sorted(kinds, reverse=True)


def test_reasoning_tokens_count_the_analysis_messages(tokenizer):
    thought, rest = tokenizer.encode(THOUGHT.removesuffix("<|start|>assistant")), \
        tokenizer.encode("<|start|>assistant<|channel|>final<|message|>Hi<|return|>")
    parser = tool_parser("harmony")
    assert parser.reasoning_tokens(tokenizer, thought + rest) == len(thought)
    assert parser.reasoning_tokens(tokenizer, rest) == 0


def test_selected_for_gpt_oss_by_model_type_or_template_markers():
    assert detect_tool_parser("{{ messages }}", "gpt_oss") == "harmony"
    assert detect_tool_parser("<|start|>assistant<|channel|>final<|message|>") == "harmony"
    assert detect_tool_parser("{{ messages }}", "llama") is None
    assert type(tool_parser("openai")) is type(tool_parser("harmony"))  # vLLM's name


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("text, accepted", [
    (CALL.removesuffix("<|call|>"), True),
    (THOUGHT + CALL.removesuffix("<|call|>"), True),
    (CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}")
     .removesuffix("<|call|>"), True),
    (FINAL.removesuffix("<|return|>"), False),  # an answer instead of a call
    (CALL.replace("Paris", "Paris").replace('"city"', '"town"').removesuffix("<|call|>"), False),
])
def test_forcing_grammar_accepts_what_the_parser_reads(tokenizer, text, accepted):
    import llguidance

    from batchrun.engine.sampling_params import GrammarSpec
    from batchrun.engine.structured import grammar_text, ll_tokenizer
    from batchrun.openai.structured import special_literal

    lark = tool_parser("harmony").grammar(TOOLS, True, special_literal(tokenizer))
    assert "<[" in lark  # the markers as the special tokens the model writes
    m = llguidance.LLMatcher(ll_tokenizer(tokenizer, [tokenizer.convert_tokens_to_ids("<|call|>")]),
                             grammar_text(GrammarSpec(lark=lark)))
    assert (m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()) == accepted
    if accepted:
        assert whole(text + "<|call|>")[2]
