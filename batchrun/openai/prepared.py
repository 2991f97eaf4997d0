"""What OpenAIServing.prepare gives back: the engine prompts and parameters of one request, and
how to turn the engine's outputs into its response body (whole or streamed)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Sequence

from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import RequestOutput
from batchrun.engine.sampling_params import SamplingParams
from batchrun.openai.chat import ChatChunks, ChatFormatter
from batchrun.openai.completions import CompletionChunks, CompletionFormatter
from batchrun.openai.embeddings import EmbeddingFormatter
from batchrun.openai.pooling_requests import ClassifyRequest, RerankRequest, ScoreRequest
from batchrun.openai.pooling_tasks import ClassifyFormatter, ScoreFormatter
from batchrun.openai.requests import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from batchrun.openai.responses_events import ResponseEvents, StreamingResponseFormatter


# Kinds whose prompts are pooled (prefill only): one engine request per prompt, no stream.
POOLED = ("embedding", "classify", "score", "rerank")


@dataclass
class PreparedRequest:
    # response: chat, answered as /v1/responses; the POOLED kinds: prefill only, no stream
    kind: Literal["chat", "completion", "response", "embedding", "classify", "score", "rerank"]
    request: ChatCompletionRequest | CompletionRequest | EmbeddingRequest | ClassifyRequest \
        | ScoreRequest | RerankRequest
    prompts: list[list[int]]  # one engine request per prompt
    params: SamplingParams  # params.n choices per prompt
    formatter: ChatFormatter | CompletionFormatter | EmbeddingFormatter | ClassifyFormatter \
        | ScoreFormatter | StreamingResponseFormatter  # the last: kind "response"
    # under a grammar: whether a choice's token ids complete it. A choice the engine ended
    # while its grammar was incomplete (it allowed no next token) finishes "length", not
    # "stop": its content is not the whole answer.
    grammar_complete: Callable[[list[int]], bool] | None = None
    multimodal: MultiModalInputs | None = None  # the prompt's images; None: text only

    def checked(self, output: RequestOutput) -> RequestOutput:
        if self.grammar_complete is None or not any(
                c.finish_reason == "stop" and c.stop_reason is None for c in output.outputs):
            return output
        choices = [replace(c, finish_reason="length") if c.finish_reason == "stop" and
                   c.stop_reason is None and not self.grammar_complete(c.token_ids) else c
                   for c in output.outputs]
        return replace(output, outputs=choices)

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    def finalize(self, outputs: RequestOutput | Sequence[RequestOutput],
                 created: int | None = None) -> dict[str, Any]:
        """The response body from the finished outputs (one per prompt, in prompt order)."""
        if isinstance(outputs, RequestOutput):
            outputs = [outputs]
        outputs = [self.checked(o) for o in outputs]
        if isinstance(self.formatter, (ChatFormatter, StreamingResponseFormatter)):  # one prompt
            return self.formatter.body(outputs[0], created)
        return self.formatter.body(outputs, created)

    @property
    def prompts_param(self) -> str:
        """The body field its prompts come from (what a 400 about their number names)."""
        if self.kind in POOLED:
            return getattr(self.request, "second_field", "input")
        return "prompt"

    def chunks(self) -> ChatChunks | CompletionChunks | ResponseEvents:
        """Per-request stream state: start(), update(output[, prompt_index]), end()."""
        fmt, request = self.formatter, self.request
        if not isinstance(fmt, (ChatFormatter, CompletionFormatter, StreamingResponseFormatter)) \
                or not isinstance(request, (ChatCompletionRequest, CompletionRequest)):
            raise TypeError(f"{self.kind} requests do not stream")
        opts = request.stream_options
        include = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        chunks: ChatChunks | CompletionChunks | ResponseEvents
        if not isinstance(fmt, CompletionFormatter):
            chunks = fmt.stream(self.params.n, include, continuous)
        else:
            chunks = fmt.stream(len(self.prompts), include, continuous)
        if self.grammar_complete is not None:  # this stream's update checks each output first
            update = chunks.update
            setattr(chunks, "update", lambda output, *rest: update(self.checked(output), *rest))
        return chunks
