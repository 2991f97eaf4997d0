"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the
`[TOOL_CALLS]` marker is a special token, so decoding keeps special tokens)."""

from __future__ import annotations

import json
from typing import Any, Callable

from batchrun.openai.parsers.base import (Parsed, ToolParser, call_schema, dump_arguments,
                                          held_prefix, random_id)

TAG = "[TOOL_CALLS]"
_decoder = json.JSONDecoder()


def _complete_items(text: str) -> list[dict]:
    """The complete objects at the start of a (possibly unfinished) JSON array."""
    items, i = [], text.find("[")
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
        objs = _complete_items(body)
        if not partial and not objs:
            return Parsed(text)
        calls: list[tuple[str, str | None]] = [
            (o["name"], dump_arguments(o.get("arguments", o.get("parameters", {})))) for o in objs]
        return Parsed(text[:at].rstrip() or None, calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str]) -> str:
        item = call_schema(tools)
        schema = {"type": "array", "items": item, "minItems": 1,
                  "x-guidance": item.pop("x-guidance")}
        if not parallel:
            schema["maxItems"] = 1
        return f"start: {literal(TAG)} %json {json.dumps(schema)}\n"
