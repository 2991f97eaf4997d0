"""Pydantic models of the OpenAI wire format: batch input lines, chat requests, chat responses.

Request models are strict about types (`"max_tokens": "100"` is an error, as it is for OpenAI) and
let unknown fields through, logging each unknown field name once, so files written for OpenAI or
vLLM still run.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      field_validator, model_validator)

log = logging.getLogger(__name__)

SUPPORTED_URLS = ("/v1/chat/completions",)


class RequestError(Exception):
    """A request the API would answer with an HTTP error (400 unless said otherwise)."""

    def __init__(self, message: str, *, code: str, param: str | None = None,
                 type: str = "invalid_request_error", status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        self.status_code = status_code


class LineError(RequestError):
    """A batch input line that cannot be run; knows its line number and custom_id if it got that far.

    `message` is what an API would answer; str() adds the line number for the error file and logs.
    """

    def __init__(self, line_number: int, error: RequestError, custom_id: str | None = None):
        super().__init__(error.message, code=error.code, param=error.param, type=error.type,
                         status_code=error.status_code)
        self.line_number = line_number
        self.custom_id = custom_id

    def __str__(self) -> str:
        return f"line {self.line_number}: {self.message}"


_warned_fields: set[str] = set()


def _warn_unknown_fields(model: BaseModel, where: str) -> None:
    for name in model.model_extra or ():
        key = f"{where}.{name}"
        if key not in _warned_fields:
            _warned_fields.add(key)
            log.warning("ignoring unsupported field %r in %s", name, where)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> "ContentPart":
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a 'text' string")
        return self


def _str_or_list(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


# Tagging the union by Python type makes a bad part report its own error instead of "input
# should be a valid string" from the other member.
Content = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[ContentPart], Tag("list")]],
    Discriminator(_str_or_list, custom_error_type="invalid_type",
                  custom_error_message="content must be a string or an array of content parts"),
]
Stop = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list")]],
    Discriminator(_str_or_list, custom_error_type="invalid_type",
                  custom_error_message="stop must be a string or an array of strings"),
]


class ChatMessage(_Strict):
    # Assistant turns copied from earlier outputs carry fields such as `refusal`; ignore them.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stop: Stop | None = None
    seed: int | None = None
    stream: bool | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's extensions, which the engine supports as well.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stop)}")
        return stop

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "ChatCompletionRequest":
        _warn_unknown_fields(self, "the request body")
        return self


class BatchInputLine(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore")
    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


# --- responses -------------------------------------------------------------------------------

class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]
    logprobs: dict[str, Any] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchLineError(BaseModel):
    code: str
    message: str
    # As in OpenAI's batch validation errors: which parameter and which input line.
    param: str | None = None
    line: int | None = None


class BatchOutputLine(BaseModel):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchLineError | None


# --- parsing a batch input line ----------------------------------------------------------------

def _error_code(error_type: str) -> str:
    if error_type == "missing":
        return "missing_required_parameter"
    if error_type.endswith("_type") or error_type.endswith("_parsing") or error_type == "model_type":
        return "invalid_type"
    return "invalid_value"


def _from_validation_error(exc: ValidationError, prefix: str) -> RequestError:
    """The first problem, named by its dotted path (body.messages.0.role)."""
    first = exc.errors(include_url=False)[0]
    # Tagged union members show up in loc as "str"/"list"; they mean nothing to a user.
    loc = [str(p) for p in first["loc"] if p not in ("str", "list")]
    path = ".".join([prefix] + loc if prefix else loc) or "(root)"
    msg = first["msg"]
    msg = msg.removeprefix("Value error, ")
    more = exc.error_count() - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    param = ".".join(loc) or None
    return RequestError(f"{path}: {msg[0].lower() + msg[1:]}", code=_error_code(first["type"]),
                        param=param)


def parse_batch_line(raw: str, line_number: int) -> tuple[BatchInputLine, ChatCompletionRequest]:
    """Validate one input line; raise LineError naming the line and the field."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LineError(line_number, RequestError(
            f"invalid JSON: {exc.msg} at column {exc.colno}",
            code="invalid_json")) from None
    if not isinstance(obj, dict):
        raise LineError(line_number, RequestError(
            f"expected a JSON object, got {type(obj).__name__}",
            code="invalid_json"))
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        line = BatchInputLine.model_validate(obj)
    except ValidationError as exc:
        raise LineError(line_number, _from_validation_error(exc, ""), custom_id) from None
    if line.url not in SUPPORTED_URLS:
        raise LineError(line_number, RequestError(
            f"url: unsupported url {line.url!r} "
            f"(supported: {', '.join(SUPPORTED_URLS)})", code="invalid_url", param="url"), custom_id)
    try:
        request = ChatCompletionRequest.model_validate(line.body)
    except ValidationError as exc:
        raise LineError(line_number, _from_validation_error(exc, "body"), custom_id) from None
    return line, request
