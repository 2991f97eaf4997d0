"""Output parsers: reasoning (`<think>`) and tool calls, chosen by name or from the template."""

from __future__ import annotations

from typing import get_args

from batchrun.options.openai import ReasoningParserName, ToolParserName
from batchrun.openai.parsers.base import Delta, ToolCall, ToolCallDelta, ToolParser
from batchrun.openai.parsers.harmony import HarmonyParser, is_harmony_template
from batchrun.openai.parsers.hermes import HermesToolParser
from batchrun.openai.parsers.llama3_json import Llama3JsonToolParser
from batchrun.openai.parsers.mistral import MistralToolParser
from batchrun.openai.parsers.reasoning import ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser, "harmony": HarmonyParser,
}
REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_prompt=True),
    "qwen3": ReasoningParser("qwen3"),
    "think": ReasoningParser("think"),
}
# A reasoning-parser name that is a whole output format's: its tool parser splits the reasoning.
FORMAT_REASONING = {"harmony"}
# Every other name a parser answers to, in this one table: vLLM's where it names the same parser
# differently (Harmony is its `openai` tool parser and `openai_gptoss` reasoning parser; it reads
# Llama 4's JSON calls with the Llama 3 parser and MiMo's thinking with Qwen3's), and short forms.
# vLLM names of formats batchrun has no parser for (pythonic, qwen3_coder, granite, ...) are not
# here: an alias must name the same format.
ALIASES = {
    "tool": {"openai": "harmony", "qwen": "hermes", "llama3": "llama3_json",
             "llama4_json": "llama3_json"},
    "reasoning": {"openai_gptoss": "harmony", "mimo": "qwen3"},
}

# The option schema declares these names for --help and job-spec validation.
if set(TOOL_PARSERS) | set(ALIASES["tool"]) != set(get_args(ToolParserName)) or \
        set(REASONING_PARSERS) | FORMAT_REASONING | set(ALIASES["reasoning"]) != \
        set(get_args(ReasoningParserName)):
    raise ImportError("batchrun.options.openai must name exactly the registered parsers")


def canonical(kind: str, name: str) -> str:
    """The registered name `name` stands for (`kind`: "tool" or "reasoning")."""
    return ALIASES[kind].get(name, name)


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[canonical("tool", name)]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r} (known: "
                         f"{', '.join(get_args(ToolParserName))})") from None


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[canonical("reasoning", name)]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} "
                         f"(known: {', '.join(get_args(ReasoningParserName))})") from None


def choose_parsers(tool: str | None, reasoning: str | None, template: str,
                   model_type: str | None) -> tuple[ToolParser | None, ReasoningParser | None]:
    """The (tool parser, reasoning parser) of --tool-parser / --reasoning-parser, the tool
    parser detected from the template where none is named. A reasoning parser that names an
    output format (`openai_gptoss`: Harmony) is that format's tool parser, which splits the
    reasoning itself; ValueError when --tool-parser names another."""
    format_ = canonical("reasoning", reasoning) if reasoning else None
    if format_ in FORMAT_REASONING:
        if tool is not None and canonical("tool", tool) != format_:
            raise ValueError(f"--reasoning-parser {reasoning} reads the {format_} output format, "
                             f"which --tool-parser {tool} does not; leave --tool-parser out or "
                             f"name {format_}")
        return tool_parser(format_), None
    name = tool or detect_tool_parser(template, model_type)
    return (tool_parser(name) if name else None,
            reasoning_parser(reasoning) if reasoning else None)


def detect_tool_parser(template: str, model_type: str | None = None) -> str | None:
    """The tool-call format a chat template teaches, from its markers (GPT-OSS by its
    config's model_type too: Harmony is its whole output format, tools or not)."""
    if model_type == "gpt_oss" or is_harmony_template(template):
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return None


__all__ = ["Delta", "ToolCall", "ToolCallDelta", "ToolParser", "ReasoningParser", "TOOL_PARSERS",
           "REASONING_PARSERS", "ALIASES", "tool_parser", "reasoning_parser", "choose_parsers",
           "detect_tool_parser"]
