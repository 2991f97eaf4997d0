"""Tool-call and reasoning parsers on recorded model outputs, whole and fed token by token."""

from __future__ import annotations

import json

import pytest

from batchrun.openai.chat import ChoiceParser
from batchrun.openai.parsers import (REASONING_PARSERS, detect_tool_parser, reasoning_parser,
                                     tool_parser)
from batchrun.openai.parsers.base import Delta

# Outputs as the models write them (Qwen2.5 / Hermes, Llama 3.1, Mistral, DeepSeek-R1 / Qwen3).
HERMES_TWO = ('I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": '
              '"get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')
HERMES_ONLY = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
LLAMA3_TAGGED = '<|python_tag|>{"name": "search", "parameters": {"query": "llguidance"}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
THINK = "<think>\nThe user greets me. Reply politely.\n</think>\n\nHello! How can I help?"


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def test_hermes_content_and_two_calls():
    parser = tool_parser("hermes")
    content, calls = parser.parse(HERMES_TWO)
    assert content == "I will check both cities."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Tokyo"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parser.parse(HERMES_ONLY)[0] is None


@pytest.mark.parametrize("text", ["Just an answer.", "Broken <tool_call>\n{\"name\": oops}\n</tool_call>",
                                  "Unfinished <tool_call>\n{\"name\": \"f\", \"argu"])
def test_hermes_without_a_parsable_call_is_all_content(text):
    assert tool_parser("hermes").parse(text) == (text, [])


def test_llama3_json_calls():
    parser = tool_parser("llama3_json")
    assert calls_of(parser.parse(LLAMA3)) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parser.parse(LLAMA3)[0] is None
    assert calls_of(parser.parse(LLAMA3_TAGGED)) == [("search", {"query": "llguidance"})]
    assert parser.parse("The weather is nice.") == ("The weather is nice.", [])
    assert parser.parse('{"not": "a call"}') == ('{"not": "a call"}', [])


def test_mistral_calls_and_nine_character_ids():
    parser = tool_parser("mistral")
    content, calls = parser.parse("Sure. " + MISTRAL)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert parser.needs_special_tokens


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", THINK, "The user greets me. Reply politely.", "Hello! How can I help?"),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>\nCut off in the mid", "Cut off in the mid", None),
    ("deepseek_r1", "Thinking began in the prompt.\n</think>\n\nAnswer.",
     "Thinking began in the prompt.", "Answer."),
    ("deepseek_r1", "Never closed", "Never closed", None),
    ("deepseek_r1", THINK, "The user greets me. Reply politely.", "Hello! How can I help?"),
])
def test_reasoning_split(name, text, reasoning, content):
    assert reasoning_parser(name).split(text) == (reasoning, content)


def feed_tokens(tokenizer, text, reasoning=None, tools=None):
    """Feed `text` one token at a time as the engine streams it; returns the merged deltas."""
    ids = tokenizer.encode(text)
    parser = ChoiceParser(reasoning_parser(reasoning) if reasoning else None,
                          tool_parser(tools) if tools else None)
    deltas, sent = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        if now.endswith("\ufffd"):
            continue
        deltas.append(parser.feed(now[len(sent):]))
        sent = now
    deltas.append(parser.finish())
    return deltas


def merged(deltas: list[Delta]):
    content = "".join(d.content for d in deltas) or None
    reasoning = "".join(d.reasoning for d in deltas) or None
    calls: dict[int, list] = {}
    for d in deltas:
        for t in d.tool_calls:
            entry = calls.setdefault(t.index, [None, None, ""])
            if t.id:
                entry[0], entry[1] = t.id, t.name
            entry[2] += t.arguments or ""
    return reasoning, content, [(n, json.loads(a)) for _, n, a in calls.values()]


@pytest.mark.parametrize("tools, text", [("hermes", HERMES_TWO), ("hermes", HERMES_ONLY),
                                         ("hermes", "Plain <b>html</b> answer with <tool"),
                                         ("llama3_json", LLAMA3), ("llama3_json", "Prose."),
                                         ("mistral", "Sure. " + MISTRAL)])
def test_token_by_token_stream_equals_whole_parse(smol_tokenizer, tools, text):
    deltas = feed_tokens(smol_tokenizer, text, tools=tools)
    content, calls = tool_parser(tools).parse(text)
    assert merged(deltas) == (None, content, [(c.name, json.loads(c.arguments)) for c in calls])
    if calls:  # the name goes out before the arguments are complete
        first = next(i for i, d in enumerate(deltas) if d.tool_calls)
        assert deltas[first].tool_calls[0].name and deltas[first].tool_calls[0].arguments == ""


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_stream_equals_whole_parse(smol_tokenizer, name):
    deltas = feed_tokens(smol_tokenizer, THINK, reasoning=name)
    reasoning, content = reasoning_parser(name).split(THINK)
    assert merged(deltas)[:2] == (reasoning, content)
    # reasoning arrives before the answer, never interleaved
    kinds = ["r" if d.reasoning else "c" for d in deltas if d.reasoning or d.content]
    assert kinds == sorted(kinds, reverse=True)


def test_reasoning_then_tool_call_stream(smol_tokenizer):
    text = "<think>\nNeed the weather.\n</think>\n\n" + HERMES_ONLY
    assert merged(feed_tokens(smol_tokenizer, text, "qwen3", "hermes")) == (
        "Need the weather.", None, [("get_time", {})])


def test_parser_detection_from_templates():
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("[TOOL_CALLS] ...") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3_json"
    assert detect_tool_parser("{{ message['content'] }}") is None
    with pytest.raises(ValueError):
        tool_parser("nope")


def test_vllms_names_are_aliases_of_the_same_parsers():
    from typing import get_args

    from batchrun.openai.parsers import ALIASES, TOOL_PARSERS, choose_parsers
    from batchrun.options.openai import ReasoningParserName, ToolParserName

    assert {name: type(tool_parser(name)) for name in ("openai", "llama4_json", "llama3", "qwen")} \
        == {"openai": TOOL_PARSERS["harmony"], "llama4_json": TOOL_PARSERS["llama3_json"],
            "llama3": TOOL_PARSERS["llama3_json"], "qwen": TOOL_PARSERS["hermes"]}
    assert reasoning_parser("mimo") is REASONING_PARSERS["qwen3"]
    # --help and job-spec validation take every name, aliases too
    assert set(ALIASES["tool"]) <= set(get_args(ToolParserName))
    assert set(ALIASES["reasoning"]) <= set(get_args(ReasoningParserName))
    # openai_gptoss is Harmony's reasoning: the Harmony tool parser splits it, whatever the template
    for name in ("openai_gptoss", "harmony"):
        tools, reasoning = choose_parsers(None, name, "{{ messages }}", None)
        assert tools.name == "harmony" and reasoning is None
    assert choose_parsers("openai", "openai_gptoss", "", None)[0].name == "harmony"
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss reads the harmony "
                                         "output format, which --tool-parser hermes does not"):
        choose_parsers("hermes", "openai_gptoss", "", None)
    tools, reasoning = choose_parsers(None, "qwen3", "<tool_call>", None)
    assert tools.name == "hermes" and reasoning is REASONING_PARSERS["qwen3"]
    with pytest.raises(ValueError, match="unknown tool parser 'pythonic'"):
        tool_parser("pythonic")  # vLLM's, a format batchrun does not read: no alias


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
])
def test_forcing_grammar_accepts_what_the_parser_reads(smol_tokenizer, name, text):
    """The grammar that forces a call and the parser that reads it agree on the format."""
    import llguidance

    from batchrun.engine.sampling_params import GrammarSpec
    from batchrun.engine.structured import grammar_text, ll_tokenizer
    from batchrun.openai.structured import special_literal

    parser = tool_parser(name)
    lark = parser.grammar(TOOLS, parallel=True, literal=special_literal(smol_tokenizer))
    matcher = llguidance.LLMatcher(ll_tokenizer(smol_tokenizer, [2]),
                                   grammar_text(GrammarSpec(lark=lark)))
    assert matcher.consume_tokens(smol_tokenizer.encode(text)), matcher.get_error()
    assert matcher.is_accepting()
    assert parser.parse(text)[1]
    single = parser.grammar(TOOLS[:1], parallel=False, literal=special_literal(smol_tokenizer))
    one = llguidance.LLMatcher(ll_tokenizer(smol_tokenizer, [2]),
                               grammar_text(GrammarSpec(lark=single)))
    accepted = one.consume_tokens(smol_tokenizer.encode(text)) and one.is_accepting()
    assert accepted == ("get_time" not in text and text.count("get_weather") == 1)


@pytest.mark.parametrize("name, text, accepted", [
    ("qwen3", '<think>\nmaybe {"a": 2}\n</think>\n\n{"a": 1}', True),
    ("qwen3", '{"a": 1}', True),
    ("qwen3", "<think>\nhm\n</think>\n\nno json", False),
    ("deepseek_r1", 'began in the prompt\n</think>\n{"a": 3}', True),
    ("deepseek_r1", "thinking\n</think>\nno json", False),
])
def test_grammar_after_reasoning(smol_tokenizer, name, text, accepted):
    import llguidance

    from batchrun.engine.sampling_params import GrammarSpec
    from batchrun.engine.structured import grammar_text, ll_tokenizer
    from batchrun.openai.structured import after_reasoning

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = after_reasoning(GrammarSpec(json_schema=schema), reasoning_parser(name))
    m = llguidance.LLMatcher(ll_tokenizer(smol_tokenizer, [2]), grammar_text(spec))
    assert (m.consume_tokens(smol_tokenizer.encode(text)) and m.is_accepting()) == accepted


MISTRAL_V11 = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
               '[TOOL_CALLS]get_time[ARGS]{}')


def test_mistral_v11_calls():
    parser = tool_parser("mistral")
    assert calls_of(parser.parse("Sure. " + MISTRAL_V11)) == [("get_weather", {"city": "Paris"}),
                                                              ("get_time", {})]
    assert parser.parse("Sure. " + MISTRAL_V11)[0] == "Sure."
    assert parser.parse("[TOOL_CALLS]get_weather[ARGS]{broken") == (
        "[TOOL_CALLS]get_weather[ARGS]{broken", [])


def test_mistral_v11_stream(smol_tokenizer):
    deltas = feed_tokens(smol_tokenizer, MISTRAL_V11, tools="mistral")
    assert merged(deltas) == (None, None, [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_mistral_v11_grammar_when_the_tokenizer_has_the_markers(smol_tokenizer):
    """A tokenizer with [TOOL_CALLS] and [ARGS] tokens (ids 1 and 3 stand in for them) gets the
    v11 grammar, with the markers as tokens."""
    import llguidance

    from batchrun.engine.sampling_params import GrammarSpec
    from batchrun.engine.structured import grammar_text, ll_tokenizer

    literal = {"[TOOL_CALLS]": "<[1]>", "[ARGS]": "<[3]>"}.get
    lark = tool_parser("mistral").grammar(TOOLS, parallel=True, literal=literal)
    m = llguidance.LLMatcher(ll_tokenizer(smol_tokenizer, [2]), grammar_text(GrammarSpec(lark=lark)))
    enc = smol_tokenizer.encode
    ids = [1] + enc("get_weather") + [3] + enc('{"city": "Paris"}') + [1] + enc("get_time") + \
        [3] + enc("{}")
    assert m.consume_tokens(ids), m.get_error()
    assert m.is_accepting()
