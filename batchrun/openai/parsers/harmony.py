"""GPT-OSS's Harmony output: a sequence of messages, each `header<|message|>body` and a
terminator, the channel in the header saying what the body is.

    <|channel|>analysis<|message|>THOUGHT<|end|>
    <|start|>assistant<|channel|>commentary<|message|>PREAMBLE<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{..}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The prompt ends with `<|start|>assistant`, so the output opens inside the first header. A
message with a recipient (`to=functions.NAME`, before or after the channel) is a tool call whose
body is the arguments; otherwise `analysis` is reasoning and `final` or `commentary` (a preamble
to a call) is content. `<|return|>` and `<|call|>` end the turn: the checkpoint's
generation_config lists them as EOS ids. This is plain text parsing of the special tokens, so the
`openai-harmony` package (which downloads its encoding at first use) is not needed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from batchrun.openai.parsers.base import JSON_STYLE, Parsed, ToolParser, held_prefix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def is_harmony_template(template: str) -> bool:
    """Whether a chat template writes Harmony (GPT-OSS's: its messages carry channels)."""
    return CHANNEL in template


def _kind(header: str) -> tuple[str, str | None]:
    """("call", tool name) | ("reasoning", None) | ("content", None) for a message header."""
    recipient = _RECIPIENT.search(header)
    if recipient:
        name = recipient.group(1)
        return "call", name[len(FUNCTIONS):] if name.startswith(FUNCTIONS) else name
    channel = _CHANNEL.search(header)
    if channel and channel.group(1) == "analysis":
        return "reasoning", None
    return "content", None


def _body_end(text: str, start: int) -> tuple[int, int]:
    """(end of the body, where the next message starts); (-1, -1) while it is open."""
    ends = [(text.find(t, start), t) for t in TERMINATORS]
    found = [(i, t) for i, t in ends if i >= 0]
    if not found:
        return -1, -1
    i, t = min(found)
    return i, i + len(t)


def _could_be_header(text: str) -> bool:
    """Whether the output opens (or may still open) with a message header."""
    head = text.lstrip()
    return not head or head.startswith((CHANNEL, START, "to=", CONSTRAIN)) or \
        any(m.startswith(head) for m in (CHANNEL, START, "to="))


class HarmonyParser(ToolParser):
    name = "harmony"
    needs_special_tokens = True  # the channel markers are special tokens
    splits_reasoning = True
    always_applies = True

    def parse_text(self, text: str, partial: bool) -> Parsed:
        if not _could_be_header(text):
            # Not Harmony (a forced response_format, a model off its format): all content.
            return Parsed(text)
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[tuple[str, str | None]] = []
        pos = 0
        while pos < len(text):
            mark = text.find(MESSAGE, pos)
            if mark < 0:
                break  # a header still being written (or cut off): nothing to show yet
            kind, name = _kind(text[pos:mark])
            body_start = mark + len(MESSAGE)
            body_end, pos = _body_end(text, body_start)
            closed = body_end >= 0
            if not closed:
                body_end = len(text)
                if partial:
                    body_end -= max(held_prefix(text, t) for t in TERMINATORS)
            body = text[body_start:body_end]
            if kind == "call":
                assert name is not None  # _kind names every call
                calls.append((name, body.strip() if closed or not partial else None))
            else:
                (reasoning if kind == "reasoning" else content).append(body)
            if not closed:
                break
        return Parsed("\n".join(content) if content else None, calls,
                      "\n".join(reasoning) if reasoning else None)

    def reasoning_tokens(self, tokenizer: Any, token_ids: list[int]) -> int:
        """The tokens of the analysis messages, their headers and terminators included."""
        count, message, header, in_body, kind = 0, [], "", False, ""
        for token in token_ids:
            piece = tokenizer.decode([token], skip_special_tokens=False)
            message.append(token)
            if not in_body:
                if piece == MESSAGE:
                    in_body, kind = True, _kind(header)[0]
                else:
                    header += piece
            elif piece in TERMINATORS:
                if kind == "reasoning":
                    count += len(message)
                message, header, in_body = [], "", False
        if in_body and kind == "reasoning":  # a thought cut short
            count += len(message)
        return count

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str]) -> str:
        """An optional thought, then one call (a Harmony turn ends at its first `<|call|>`, so
        `parallel` changes nothing); the EOS that ends it is `<|call|>`."""
        calls = []
        for tool in tools:
            fn = tool["function"]
            params = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_STYLE}
            header = json.dumps(f"commentary to={FUNCTIONS}{fn['name']} ")
            calls.append(f'{literal(CHANNEL)} {header} {literal(CONSTRAIN)} "json" '
                         f'{literal(MESSAGE)} %json {json.dumps(params)}')
        return f"start: thought? call\n{_thought(literal)}call: {' | '.join(calls)}\n"

    def answer_grammar(self, rules: str, body: str, literal: Callable[[str], str]) -> str:
        """response_format's answer in the final channel, after an optional thought."""
        return (f'start: thought? {literal(CHANNEL)} "final" {literal(MESSAGE)} {body}\n'
                f"{_thought(literal)}{rules}")


def _thought(literal: Callable[[str], str]) -> str:
    """The grammar rule of an analysis message and the header of the message after it."""
    return (f'thought: {literal(CHANNEL)} "analysis" {literal(MESSAGE)} /(.|\\n)*/ {literal(END)} '
            f'{literal(START)} "assistant"\n')
