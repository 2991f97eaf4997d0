"""Reasoning in `<think>…</think>`: moved to `reasoning_content`, the rest stays `content`.

Two conventions differ only when the end tag is missing:
- deepseek_r1: the template may open `<think>` in the prompt, so the output starts inside the
  thought; without `</think>` everything is reasoning (the thought was cut short).
- qwen3: thinking can be switched off, so output without `</think>` is reasoning only if it
  opens with `<think>`; otherwise it is all content.
Reasoning is stripped of surrounding whitespace and content of leading whitespace (the blank
line templates put after `</think>`).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.openai.parsers.base import Delta, held_prefix


@dataclass
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_in_prompt: bool = False  # deepseek_r1: no `</think>` means all reasoning

    def split(self, text: str, partial: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content). In partial mode, only what can no longer change."""
        body = text.lstrip()
        opened = body.startswith(self.start)
        if opened:
            body = body[len(self.start):]
        end = body.find(self.end)
        if end >= 0:
            return body[:end].strip() or None, body[end + len(self.end):].lstrip() or None
        if partial:
            stripped = text.lstrip()
            if not opened and self.start.startswith(stripped):
                return None, None  # could still be opening a thought
            if opened or self.starts_in_prompt:
                return body[:len(body) - held_prefix(body, self.end)].strip() or None, None
            return None, text
        if opened or self.starts_in_prompt:
            return body.strip() or None, None
        return None, text

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class ReasoningStream:
    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = [0, 0]  # characters of reasoning and content already sent

    def feed(self, delta: str) -> Delta:
        self.text += delta
        return self._diff(*self.parser.split(self.text, partial=True))

    def finish(self) -> Delta:
        return self._diff(*self.parser.split(self.text))

    def _diff(self, reasoning: str | None, content: str | None) -> Delta:
        out = Delta()
        r, c = reasoning or "", content or ""
        if len(r) > self.sent[0]:
            out.reasoning, self.sent[0] = r[self.sent[0]:], len(r)
        if len(c) > self.sent[1]:
            out.content, self.sent[1] = c[self.sent[1]:], len(c)
        return out


def reasoning_token_count(tokenizer, token_ids: list[int], parser: ReasoningParser,
                          skip_special_tokens: bool = True) -> int:
    """Output tokens spent thinking: up to and including the one that completes the end tag
    (all of them when the thought never closed)."""
    def has_end(k: int) -> bool:
        return parser.end in tokenizer.decode(token_ids[:k], skip_special_tokens=skip_special_tokens)

    if not has_end(len(token_ids)):
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has_end(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
