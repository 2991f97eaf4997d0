"""Output parsers: reasoning (`<think>`) and tool calls, chosen by name or from the template."""

from __future__ import annotations

from typing import get_args

from batchrun.options.openai import ReasoningParserName, ToolParserName
from batchrun.openai.parsers.base import Delta, ToolCall, ToolCallDelta, ToolParser
from batchrun.openai.parsers.harmony import HarmonyParser
from batchrun.openai.parsers.hermes import HermesToolParser
from batchrun.openai.parsers.llama3_json import Llama3JsonToolParser
from batchrun.openai.parsers.mistral import MistralToolParser
from batchrun.openai.parsers.reasoning import ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser, "llama3": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "harmony": HarmonyParser, "openai": HarmonyParser,  # vLLM's name for GPT-OSS's
}
REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_prompt=True),
    "qwen3": ReasoningParser("qwen3"),
    "think": ReasoningParser("think"),
}

# The option schema declares these names for --help and job-spec validation.
if set(TOOL_PARSERS) != set(get_args(ToolParserName)) or \
        set(REASONING_PARSERS) != set(get_args(ReasoningParserName)):
    raise ImportError("batchrun.options.openai must name exactly the registered parsers")


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r} (known: {', '.join(TOOL_PARSERS)})") from None


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} "
                         f"(known: {', '.join(REASONING_PARSERS)})") from None


def detect_tool_parser(template: str, model_type: str | None = None) -> str | None:
    """The tool-call format a chat template teaches, from its markers (GPT-OSS by its
    config's model_type too: Harmony is its whole output format, tools or not)."""
    if model_type == "gpt_oss" or "<|channel|>" in template:
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return None


__all__ = ["Delta", "ToolCall", "ToolCallDelta", "ToolParser", "ReasoningParser", "TOOL_PARSERS",
           "REASONING_PARSERS", "tool_parser", "reasoning_parser", "detect_tool_parser"]
