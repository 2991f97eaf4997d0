"""Mistral tool calls, both generations of the format:
- v3 (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
- v11+ (Mistral Small 3.x and later): `[TOOL_CALLS]name[ARGS]{...}`, repeated per call.
The markers are special tokens, so decoding keeps special tokens."""

from __future__ import annotations

import json
from typing import Any, Callable

from batchrun.openai.parsers.base import (JSON_STYLE, Parsed, ToolParser, call_schema,
                                          dump_arguments, held_prefix, random_id)

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_decoder = json.JSONDecoder()


def _complete_items(text: str) -> list[dict]:
    """The complete objects at the start of a (possibly unfinished) JSON array."""
    items: list[dict] = []
    i = text.find("[")
    if i < 0:
        return items
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\n,":
            i += 1
        try:
            obj, i = _decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            items.append(obj)


def _named_calls(text: str) -> list[tuple[str, str]]:
    """v11: the complete `name[ARGS]{...}` calls of the text after the first marker."""
    calls = []
    for chunk in text.split(TAG):
        name, sep, rest = chunk.partition(ARGS)
        if not sep or not name.strip():
            continue
        try:
            args, _ = _decoder.raw_decode(rest.lstrip())
        except json.JSONDecodeError:
            continue
        calls.append((name.strip(), dump_arguments(args)))
    return calls


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def new_id(self) -> str:
        return random_id(9)  # Mistral's templates require 9 alphanumerics

    def parse_text(self, text: str, partial: bool) -> Parsed:
        at = text.find(TAG)
        if at < 0:
            if partial:
                return Parsed(text[:len(text) - held_prefix(text, TAG)].rstrip())
            return Parsed(text)
        body = text[at + len(TAG):]
        if body.lstrip().startswith("["):
            calls = [(o["name"], dump_arguments(o.get("arguments", o.get("parameters", {}))))
                     for o in _complete_items(body)]
        else:
            calls = _named_calls(body)
        if not partial and not calls:
            return Parsed(text)
        return Parsed(text[:at].rstrip() or None, list(calls))

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str]) -> str:
        if literal(ARGS).startswith("<["):  # the tokenizer knows [ARGS]: the v11 format
            calls = []
            for tool in tools:
                fn = tool["function"]
                params = {**(fn.get("parameters") or {"type": "object"}),
                          "x-guidance": JSON_STYLE}
                calls.append(f"{json.dumps(fn['name'])} {literal(ARGS)} %json {json.dumps(params)}")
            repeat = "+" if parallel else ""
            return (f"start: ({literal(TAG)} call){repeat}\n"
                    f"call: {' | '.join(calls)}\n")
        item = call_schema(tools)
        schema = {"type": "array", "items": item, "minItems": 1,
                  "x-guidance": item.pop("x-guidance")}
        if not parallel:
            schema["maxItems"] = 1
        return f"start: {literal(TAG)} %json {json.dumps(schema)}\n"
