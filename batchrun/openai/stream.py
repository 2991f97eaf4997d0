"""Engine outputs -> OpenAI `chat.completion.chunk` objects for a streamed response.

The engine streams cumulative outputs, one choice each (text already holds back anything that
could still turn into a stop string); this keeps per-choice state and emits only what is new.
The caller frames each chunk as an SSE event.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchrun.engine.outputs import CompletionOutput, RequestOutput


@dataclass
class _Choice:
    text_sent: int = 0  # characters of the cumulative text already sent
    tokens: int = 0  # completion tokens seen so far
    finished: bool = False


class ChatStream:
    def __init__(self, model_name: str, n: int = 1, include_usage: bool = False,
                 continuous_usage: bool = False, created: int | None = None,
                 completion_id: str | None = None):
        self.model_name = model_name
        self.id = completion_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.choices = [_Choice() for _ in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.model_name,
                                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        elif self.continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    def usage(self) -> dict[str, Any]:
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def start(self, prompt_tokens: int) -> list[dict]:
        """The first chunk of each choice: the role, empty content."""
        self.prompt_tokens = prompt_tokens
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def update(self, output: RequestOutput) -> list[dict]:
        """Chunks for whatever `output` adds over what was sent."""
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        chunks = []
        for c in output.outputs:
            chunk = self._choice_delta(c)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _choice_delta(self, c: CompletionOutput) -> dict | None:
        state = self.choices[c.index]
        if state.finished:
            return None
        state.tokens = len(c.token_ids)
        delta: dict[str, Any] = {}
        new_text = c.text[state.text_sent:]
        if new_text:
            delta["content"] = new_text
            state.text_sent = len(c.text)
        finish = c.finish_reason
        if finish is not None:
            state.finished = True
            finish = "stop" if finish == "abort" else finish
        if not delta and finish is None:
            return None
        return self._chunk([{"index": c.index, "delta": delta, "logprobs": None,
                             "finish_reason": finish}])

    def end(self) -> list[dict]:
        """The usage chunk (`choices: []`) when the client asked for it."""
        if not self.include_usage:
            return []
        return [self._chunk([], usage=self.usage())]
