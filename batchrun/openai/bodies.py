"""OpenAI response bodies (chat.completion, text_completion, usage) and the batch output / error
file lines around them."""

from __future__ import annotations

import time
import uuid
from typing import Any

from batchrun.engine.outputs import RequestOutput
from batchrun.openai.wire import (BatchLineError, BatchOutputLine, BatchResponse, ErrorBody,
                                  LineError, RequestError)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def engine_error(output: RequestOutput) -> RequestError | None:
    """The error to report for an output the engine failed or aborted, else None."""
    if output.error:
        return RequestError(output.error, code="engine_error", type="server_error",
                            status_code=500)
    if any(c.finish_reason == "abort" for c in output.outputs):
        return RequestError("the request was aborted before it finished", code="aborted",
                            type="server_error", status_code=500)
    return None


def completion_id(kind: str = "chat") -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def chat_completion_body(choices: list[dict], usage_: dict, model_name: str,
                         system_fingerprint: str | None = None, created: int | None = None,
                         id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or completion_id("chat"), "object": "chat.completion",
            "created": int(time.time()) if created is None else created, "model": model_name,
            "choices": choices, "usage": usage_, "system_fingerprint": system_fingerprint}


def text_completion_body(choices: list[dict], usage_: dict, model_name: str,
                         system_fingerprint: str | None = None, created: int | None = None,
                         id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or completion_id("text"), "object": "text_completion",
            "created": int(time.time()) if created is None else created, "model": model_name,
            "choices": choices, "usage": usage_, "system_fingerprint": system_fingerprint}


class StreamChunks:
    """The envelope the chat and completions streams share: id, object, created, model, the
    choices, and the usage where asked for (every chunk with continuous usage)."""

    object_name = ""
    fmt: Any  # the formatter: model_name, system_fingerprint
    id: str
    created: int
    continuous_usage: bool

    def usage(self) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.object_name, "created": self.created,
                 "model": self.fmt.model_name, "system_fingerprint": self.fmt.system_fingerprint,
                 "choices": choices}
        if usage_ is not None:
            chunk["usage"] = usage_
        elif self.continuous_usage:
            chunk["usage"] = self.usage()
        return chunk


def batch_output_line(custom_id: str, request_id: str, body: dict) -> dict:
    return BatchOutputLine(
        id=f"batch_req_{uuid.uuid4().hex}", custom_id=custom_id,
        response=BatchResponse(status_code=200, request_id=request_id, body=body),
        error=None).model_dump()


def error_body(error: RequestError, message: str | None = None) -> dict:
    return {"error": ErrorBody(message=error.message if message is None else message,
                               type=error.type, param=error.param, code=error.code).model_dump()}


def batch_error_line(error: RequestError, custom_id: str | None = None,
                     request_id: str | None = None, source: str | None = None) -> dict:
    """An error file line, shaped as OpenAI's BatchRequestOutput. A line that got far enough to
    have a custom_id failed with an HTTP answer: `response` carries it (the line number, and the
    source file where a job reads several, lead its body's error message) and `error` is null,
    as OpenAI sets `error` only for failures without an HTTP response. A line that could not be
    read far enough to have a custom_id (OpenAI rejects such lines before running anything) has
    a null `response` and `error` {code, message, param, line}, the fields of OpenAI's BatchError.
    """
    line = error.line_number if isinstance(error, LineError) else None
    if isinstance(error, LineError) and custom_id is None:
        custom_id = error.custom_id
    message = f"{source}: {error}" if source else str(error)
    if custom_id is None:
        return BatchOutputLine(
            id=f"batch_req_{uuid.uuid4().hex}", custom_id=None, response=None,
            error=BatchLineError(code=error.code, message=message, param=error.param, line=line),
        ).model_dump()
    body = error_body(error, message)
    return BatchOutputLine(
        id=f"batch_req_{uuid.uuid4().hex}", custom_id=custom_id,
        response=BatchResponse(status_code=error.status_code,
                               request_id=request_id or new_request_id(), body=body),
        error=None).model_dump()


def line_error(record: dict) -> dict | None:
    """The error of a batch output or error file line ({code, message, param, ...}), wherever
    it is: the HTTP error body of its `response`, or its `error` (no HTTP answer); None for a
    successful line. Also reads lines written before errors moved into the response body."""
    if record.get("error"):
        return record["error"]
    response = record.get("response") or {}
    if response.get("status_code", 200) != 200:
        body = response.get("body")
        error = body.get("error") if isinstance(body, dict) else None
        return error if isinstance(error, dict) else {
            "code": None, "message": f"HTTP {response.get('status_code')}"}
    return None
