"""Engine outputs -> chat.completion and chat.completion.chunk, through the output parsers.

One ChatFormatter per request: it knows which parsers apply, whether a named tool was forced,
the echo prefix and the logprobs setting. Each choice gets its own ChoiceParser, so n > 1
choices never share parser state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.openai.logprobs import TokenText, chat_logprobs
from batchrun.openai.prompt_logprobs import vllm_prompt_logprobs
from batchrun.openai.parsers import Delta, ToolParser
from batchrun.openai.parsers.base import ToolStream
from batchrun.openai.parsers.reasoning import (ReasoningParser, ReasoningStream,
                                               reasoning_token_count)
from batchrun.openai.bodies import StreamChunks, chat_completion_body, completion_id, usage


class ChoiceParser:
    """Incremental parse of one choice: text deltas in, content / reasoning / tool-call deltas
    out. Reasoning is split off first; the tool parser sees only the content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None
        self.tools: ToolStream | None = tools.stream() if tools else None

    def _then_tools(self, delta: Delta, final: bool) -> Delta:
        if self.tools is None:
            return delta
        inner = self.tools.feed(delta.content) if delta.content else Delta()
        if final:
            last = self.tools.finish()
            inner.content += last.content
            inner.reasoning += last.reasoning
            inner.tool_calls += last.tool_calls
        return Delta(inner.content, delta.reasoning + inner.reasoning, inner.tool_calls)

    def feed(self, text: str) -> Delta:
        delta = self.reasoning.feed(text) if self.reasoning else Delta(content=text)
        return self._then_tools(delta, final=False)

    def finish(self) -> Delta:
        delta = self.reasoning.finish() if self.reasoning else Delta()
        return self._then_tools(delta, final=True)


@dataclass
class ChatFormatter:
    model_name: str
    tokenizer: Any
    texts: TokenText
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    named_tool: bool = False  # tool_choice named a function: its call is the expected answer
    echo: str = ""  # the final assistant message, when `echo` asks to repeat it
    top_logprobs: int | None = None  # None = no logprobs
    system_fingerprint: str | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top k), None = not asked

    def _finish_reason(self, c: CompletionOutput, called: bool) -> str:
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
        if called and reason == "stop" and not self.named_tool:
            return "tool_calls"
        return reason

    @property
    def splits_reasoning(self) -> bool:
        """Whether messages carry reasoning_content: a reasoning parser, or a tool parser whose
        format holds the thought too (Harmony)."""
        return self.reasoning is not None or bool(self.tools and self.tools.splits_reasoning)

    def _reasoning_tokens(self, c: CompletionOutput, reasoning: str | None) -> int:
        if not reasoning or not self.splits_reasoning:
            return 0
        if self.reasoning is None:
            assert self.tools is not None  # splits_reasoning: the tool format does
            return self.tools.reasoning_tokens(self.tokenizer, c.token_ids)
        return reasoning_token_count(self.tokenizer, c.token_ids, self.reasoning,
                                     self.skip_special_tokens)

    def _logprobs(self, c: CompletionOutput, start: int = 0, end: int | None = None):
        if self.top_logprobs is None:
            return None
        return chat_logprobs((c.logprobs or [])[start:end], self.texts, self.top_logprobs)

    def _text(self, c: CompletionOutput) -> str:
        """The choice's text without the EOS token that ended it, which decoding keeps when
        special tokens are kept (parsers whose markers are special tokens)."""
        if self.skip_special_tokens or not c.token_ids or c.stop_reason is not None:
            return c.text
        last = c.token_ids[-1]
        if last in getattr(self.tokenizer, "all_special_ids", ()):
            eos = self.tokenizer.decode([last], skip_special_tokens=False)
            if eos and c.text.endswith(eos):
                return c.text[:-len(eos)]
        return c.text

    def choice(self, c: CompletionOutput) -> tuple[dict[str, Any], int]:
        """(the choice object, its reasoning tokens)."""
        parser = ChoiceParser(self.reasoning, self.tools)
        delta = parser.feed(self._text(c))
        last = parser.finish()
        reasoning = (delta.reasoning + last.reasoning) or None
        calls = self._calls(delta.tool_calls + last.tool_calls)
        # Nothing generated at all (EOS first, e.g. forced by logit_bias) is "" as OpenAI
        # answers; null only where the turn holds tool calls or reasoning instead.
        content = (delta.content + last.content) or (None if calls or reasoning else "")
        if self.echo:
            content = self.echo + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        if self.splits_reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": c.index, "message": message,
                  "finish_reason": self._finish_reason(c, bool(calls)),
                  "logprobs": self._logprobs(c)}
        return choice, self._reasoning_tokens(c, reasoning)

    @staticmethod
    def _calls(deltas) -> list[dict[str, Any]]:
        calls: dict[int, dict[str, Any]] = {}
        for d in deltas:
            call = calls.setdefault(d.index, {"id": "", "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            if d.id is not None:
                call["id"] = d.id
            if d.name is not None:
                call["function"]["name"] = d.name
            if d.arguments:
                call["function"]["arguments"] += d.arguments
        return [calls[i] for i in sorted(calls)]

    def body(self, output: RequestOutput, created: int | None = None) -> dict[str, Any]:
        choices, reasoning_tokens = [], 0
        for c in sorted(output.outputs, key=lambda c: c.index):
            choice, r = self.choice(c)
            choices.append(choice)
            reasoning_tokens += r
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        use = usage(len(output.prompt_token_ids), completion_tokens, output.num_cached_tokens,
                    reasoning_tokens if self.splits_reasoning else None)
        body = chat_completion_body(choices, use, self.model_name, self.system_fingerprint,
                                    created)
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = None if output.prompt_logprobs is None else \
                vllm_prompt_logprobs(output.prompt_logprobs, self.texts, self.prompt_logprobs)
        return body

    def stream(self, n: int, include_usage: bool = False,
               continuous_usage: bool = False) -> "ChatChunks":
        return ChatChunks(self, n, include_usage, continuous_usage)


class _ChoiceState:
    def __init__(self, formatter: ChatFormatter):
        self.parser = ChoiceParser(formatter.reasoning, formatter.tools)
        self.text_sent = 0
        self.tokens_sent = 0
        self.tokens = 0
        self.reasoning_tokens = 0
        self.reasoning = ""
        self.called = False
        self.finished = False


class ChatChunks(StreamChunks):
    """chat.completion.chunk objects from the engine's cumulative per-choice stream outputs."""

    object_name = "chat.completion.chunk"

    def __init__(self, fmt: ChatFormatter, n: int, include_usage: bool, continuous_usage: bool):
        self.fmt = fmt
        self.id = completion_id("chat")
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.choices = [_ChoiceState(fmt) for _ in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def usage(self) -> dict[str, Any]:
        completion = sum(c.tokens for c in self.choices)
        reasoning = sum(c.reasoning_tokens for c in self.choices) \
            if self.fmt.splits_reasoning else None
        return usage(self.prompt_tokens, completion, self.cached_tokens, reasoning)

    def start(self) -> list[dict]:
        """The first chunk of each choice: the role (and the echoed message, if any)."""
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": self.fmt.echo},
                              "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def update(self, output: RequestOutput) -> list[dict]:
        """Chunks for whatever `output` adds over what was sent."""
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        chunks = []
        for c in output.outputs:
            chunk = self._choice_chunk(c)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _choice_chunk(self, c: CompletionOutput) -> dict | None:
        state = self.choices[c.index]
        if state.finished:
            return None
        state.tokens = len(c.token_ids)
        delta = state.parser.feed(c.text[state.text_sent:])
        state.text_sent = len(c.text)
        finish = None
        if c.finish_reason is not None:
            state.finished = True
            last = state.parser.finish()
            delta = Delta(delta.content + last.content, delta.reasoning + last.reasoning,
                          delta.tool_calls + last.tool_calls)
        state.reasoning += delta.reasoning
        state.called = state.called or bool(delta.tool_calls)
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            body["tool_calls"] = [d.as_openai() for d in delta.tool_calls]
        logprobs = None
        if self.fmt.top_logprobs is not None and len(c.token_ids) > state.tokens_sent and (
                body or state.finished):
            logprobs = self.fmt._logprobs(c, state.tokens_sent, len(c.token_ids))
            state.tokens_sent = len(c.token_ids)
        if state.finished:
            finish = self.fmt._finish_reason(c, state.called)
            state.reasoning_tokens = self.fmt._reasoning_tokens(c, state.reasoning)
        if not body and finish is None:
            return None
        return self.chunk([{"index": c.index, "delta": body, "logprobs": logprobs,
                             "finish_reason": finish}])

    def end(self) -> list[dict]:
        """The usage chunk (`choices: []`) when the client asked for it."""
        if not self.include_usage:
            return []
        return [self.chunk([], usage_=self.usage())]
