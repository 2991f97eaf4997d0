"""parallel_tool_calls=false over any tool parser."""

from __future__ import annotations

from batchrun.openai.parsers.base import ToolParser


class FirstCallOnly(ToolParser):
    """parallel_tool_calls=false: only the first call counts."""

    def __init__(self, inner: ToolParser):
        self.inner = inner
        self.name = inner.name
        self.needs_special_tokens = inner.needs_special_tokens
        self.splits_reasoning = inner.splits_reasoning
        self.always_applies = inner.always_applies

    def new_id(self) -> str:
        return self.inner.new_id()

    def reasoning_tokens(self, tokenizer, token_ids):
        return self.inner.reasoning_tokens(tokenizer, token_ids)

    def parse_text(self, text: str, partial: bool):
        parsed = self.inner.parse_text(text, partial)
        parsed.calls = parsed.calls[:1]
        return parsed
