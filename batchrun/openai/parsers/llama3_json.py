"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `; `,
optionally after `<|python_tag|>`."""

from __future__ import annotations

import json
from typing import Any, Callable

from batchrun.openai.parsers.base import Parsed, ToolParser, call_schema, dump_arguments

TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


def _objects(text: str) -> tuple[list[dict], bool]:
    """The JSON objects of `a; b; c`, and whether the text is exactly that (fully parsed)."""
    objs: list[dict] = []
    i = 0
    while True:
        while i < len(text) and text[i] in " \t\n;":
            i += 1
        if i >= len(text):
            return objs, True
        try:
            obj, i = _decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return objs, False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return objs, False
        objs.append(obj)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse_text(self, text: str, partial: bool) -> Parsed:
        body = text.strip()
        if body.startswith(TAG):
            body = body[len(TAG):].lstrip()
        elif not body.startswith("{"):
            if partial and (not body or TAG.startswith(body)):
                return Parsed(None)  # not yet known whether this is a call
            return Parsed(text)
        objs, complete = _objects(body)
        calls: list[tuple[str, str | None]] = [
            (o["name"], dump_arguments(o.get("parameters", o.get("arguments", {})))) for o in objs]
        if partial:
            return Parsed(None, calls)
        if not complete or not calls:
            return Parsed(text)
        return Parsed(None, calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str]) -> str:
        schema = json.dumps(call_schema(tools, "parameters"))
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: %json {schema}\n"
