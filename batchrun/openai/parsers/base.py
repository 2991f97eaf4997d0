"""What parsers produce, and the incremental wrapper every tool parser streams through.

A parser turns the full text of a choice into (content, tool calls). Streaming re-parses the
cumulative text in "partial" mode after each delta and sends only what is new, so a stream
concatenates to exactly what the non-streaming parse returns.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable

_ALNUM = string.ascii_letters + string.digits
# llguidance options for forced JSON: canonical `json.dumps` spacing, as the engine uses for
# response_format, so a small model has no room for runaway whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def random_id(length: int = 24) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(length))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def as_openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        fn = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        if fn:
            d["function"] = fn
        return d


@dataclass
class Parsed:
    """A parse of (possibly partial) text. In partial mode, calls may lack arguments (None) and
    content is only what can no longer change."""
    content: str | None
    calls: list[tuple[str, str | None]] = field(default_factory=list)  # (name, arguments)
    reasoning: str | None = None  # a parser whose format carries the thought (splits_reasoning)


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def dump_arguments(args: Any) -> str:
    """Arguments as OpenAI's JSON text (models emit them as an object)."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolStream:
    """Per-choice incremental state over a parse function."""

    def __init__(self, parse: Callable[[str, bool], Parsed], new_id: Callable[[], str]):
        self._parse = parse
        self._new_id = new_id
        self.text = ""
        self.content_sent = 0
        self.reasoning_sent = 0
        self.ids: list[str] = []
        self.names_sent = 0  # calls whose id and name went out
        self.args_sent: list[bool] = []

    def feed(self, delta: str) -> Delta:
        self.text += delta
        return self._diff(self._parse(self.text, True))

    def finish(self) -> Delta:
        return self._diff(self._parse(self.text, False))

    def _diff(self, parsed: Parsed) -> Delta:
        out = Delta()
        content = parsed.content or ""
        if len(content) > self.content_sent:
            out.content = content[self.content_sent:]
            self.content_sent = len(content)
        reasoning = parsed.reasoning or ""
        if len(reasoning) > self.reasoning_sent:
            out.reasoning = reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(reasoning)
        for i, (name, args) in enumerate(parsed.calls):
            if i >= self.names_sent:
                self.ids.append(self._new_id())
                self.args_sent.append(False)
                out.tool_calls.append(ToolCallDelta(i, id=self.ids[i], name=name, arguments=""))
                self.names_sent = i + 1
            if args is not None and not self.args_sent[i]:
                self.args_sent[i] = True
                out.tool_calls.append(ToolCallDelta(i, arguments=args))
        return out


class ToolParser:
    """Turns model output into content and tool calls; knows how to force a call by grammar."""

    name = ""
    # The call markers are special tokens that decoding must keep (skip_special_tokens=False).
    needs_special_tokens = False
    # The format also carries the thought (Parsed.reasoning -> reasoning_content).
    splits_reasoning = False
    # The format is the whole output (Harmony's channels), not only calls: it is parsed for
    # every chat request, with tools or without.
    always_applies = False

    def new_id(self) -> str:
        return f"call_{random_id()}"

    def parse_text(self, text: str, partial: bool) -> Parsed:
        raise NotImplementedError

    def reasoning_tokens(self, tokenizer: Any, token_ids: list[int]) -> int:
        """Output tokens spent thinking (parsers that split reasoning)."""
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        parsed = self.parse_text(text, False)
        calls = [ToolCall(name, args or "{}", self.new_id()) for name, args in parsed.calls]
        return parsed.content, calls

    def stream(self) -> ToolStream:
        return ToolStream(self.parse_text, self.new_id)

    def answer_grammar(self, rules: str, body: str, literal: Callable[[str], str]) -> str | None:
        """A Lark grammar putting an answer held to `body` (`rules` define what it names) where
        the format wants it; None: the answer is the raw output."""
        return None

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str]) -> str:
        """A Lark grammar (llguidance dialect) whose language is one or more calls of `tools`
        (exactly one unless `parallel`). `literal(tag)` spells a marker as a terminal: the
        special token when the tokenizer has one, else the quoted text."""
        raise NotImplementedError


def call_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call object {"name": ..., args_key: ...} of any of `tools`."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {
            "name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_STYLE}
