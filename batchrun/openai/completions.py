"""Engine outputs -> /v1/completions `text_completion` bodies and stream chunks.

A request with several prompts runs as one engine request per prompt; choice i*n + j is
choice j of prompt i, as OpenAI numbers them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.openai.logprobs import TokenText, completion_logprobs
from batchrun.openai.prompt_logprobs import echo_logprobs, text_length, vllm_prompt_logprobs
from batchrun.openai.bodies import StreamChunks, completion_id, text_completion_body, usage


def _finish(c: CompletionOutput) -> str:
    return c.finish_reason if c.finish_reason in ("stop", "length") else "stop"


@dataclass
class CompletionFormatter:
    model_name: str
    texts: TokenText
    n: int = 1
    logprobs: int | None = None
    system_fingerprint: str | None = None
    echo: Sequence[str] | None = None  # each prompt's text, when `echo` repeats it
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top k), None = not asked

    def _logprobs(self, c: CompletionOutput, start: int = 0, end: int | None = None,
                  offset: int = 0):
        if self.logprobs is None:
            return None
        return completion_logprobs((c.logprobs or [])[start:end], self.texts, offset)

    def _echoed_logprobs(self, c: CompletionOutput, out: RequestOutput):
        """The prompt's tokens, then the completion's (echo with logprobs)."""
        if self.logprobs is None or out.prompt_logprobs is None:
            return self._logprobs(c)
        prompt = echo_logprobs(out.prompt_logprobs, self.texts, self.logprobs)
        gen = self._logprobs(c, offset=text_length(out.prompt_logprobs, self.texts))
        return {key: prompt[key] + gen[key] for key in prompt}

    def body(self, outputs: Sequence[RequestOutput], created: int | None = None) -> dict[str, Any]:
        choices = []
        for p, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                choice = {"index": p * self.n + c.index, "text": c.text,
                          "logprobs": self._logprobs(c), "finish_reason": _finish(c)}
                if self.echo is not None:
                    choice["text"] = self.echo[p] + c.text
                    choice["logprobs"] = self._echoed_logprobs(c, out)
                if self.prompt_logprobs is not None:
                    # In the choice, as vLLM puts it: each prompt of a request has its own.
                    choice["prompt_logprobs"] = None if out.prompt_logprobs is None else \
                        vllm_prompt_logprobs(out.prompt_logprobs, self.texts,
                                             self.prompt_logprobs)
                choices.append(choice)
        use = usage(sum(len(o.prompt_token_ids) for o in outputs),
                    sum(len(c.token_ids) for o in outputs for c in o.outputs),
                    sum(o.num_cached_tokens for o in outputs))
        return text_completion_body(choices, use, self.model_name, self.system_fingerprint,
                                    created)

    def stream(self, num_prompts: int, include_usage: bool = False,
               continuous_usage: bool = False) -> "CompletionChunks":
        return CompletionChunks(self, num_prompts, include_usage, continuous_usage)


class CompletionChunks(StreamChunks):
    object_name = "text_completion"

    def __init__(self, fmt: CompletionFormatter, num_prompts: int, include_usage: bool,
                 continuous_usage: bool):
        self.fmt = fmt
        self.id = completion_id("text")
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        size = num_prompts * fmt.n
        self.text_sent = [0] * size
        self.tokens_sent = [0] * size
        self.tokens = [0] * size
        self.finished = [False] * size
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens), sum(self.tokens), sum(self.cached_tokens))

    def start(self) -> list[dict]:
        return []

    def update(self, output: RequestOutput, prompt_index: int = 0) -> list[dict]:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        chunks = []
        for c in output.outputs:
            i = prompt_index * self.fmt.n + c.index
            if self.finished[i]:
                continue
            self.tokens[i] = len(c.token_ids)
            text = c.text[self.text_sent[i]:]
            finish = _finish(c) if c.finish_reason is not None else None
            if not text and finish is None:
                continue
            logprobs = self.fmt._logprobs(c, self.tokens_sent[i], len(c.token_ids),
                                          self.text_sent[i])
            self.text_sent[i] = len(c.text)
            self.tokens_sent[i] = len(c.token_ids)
            self.finished[i] = finish is not None
            chunks.append(self.chunk([{"index": i, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish}]))
        return chunks

    def end(self) -> list[dict]:
        return [self.chunk([], usage_=self.usage())] if self.include_usage else []
