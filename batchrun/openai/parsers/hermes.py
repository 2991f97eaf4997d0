"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import orjson

from batchrun.openai.parsers.base import Parsed, ToolParser, call_schema, dump_arguments, held_prefix

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _call(body: str) -> tuple[str, str] | None:
    try:
        obj = orjson.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], dump_arguments(obj.get("arguments", obj.get("parameters", {})))


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse_text(self, text: str, partial: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            if partial:  # hold back what could still become the start tag, and whitespace
                return Parsed(text[:len(text) - held_prefix(text, START)].rstrip())
            return Parsed(text)
        calls: list[tuple[str, str | None]] = []
        for chunk in text[first:].split(START)[1:]:
            closed = END in chunk
            body = chunk.split(END)[0] if closed else chunk
            call = _call(body.strip())
            if call is not None and (closed or not partial):
                calls.append(call)
            elif partial and not closed:
                name = _NAME.search(body)
                if name:
                    calls.append((json.loads(f'"{name.group(1)}"'), None))
        before = text[:first].rstrip()
        if not calls and not partial:
            return Parsed(text)  # nothing parsable: the model's text is the answer
        return Parsed(before or None, calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str]) -> str:
        schema = json.dumps(call_schema(tools))
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{more}\n"
                f'call: {literal(START)} "\\n" %json {schema} "\\n" {literal(END)}\n')
