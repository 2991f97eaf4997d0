"""The OpenAI wire format around the request bodies: the endpoints' URLs, request errors, batch
input and output lines, and parsing a body or a batch line into its request model.

The request models themselves are in requests.py (chat, completions, embeddings),
responses_request.py (/v1/responses) and pooling_requests.py (classify, score, rerank).
An endpoint plugs in here (ENDPOINTS: its URL and body model; the server routes every URL in it)
and in OpenAIServing.prepare (what its body becomes).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Iterable, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from batchrun.openai.requests import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                      StrictModel)
from batchrun.openai.pooling_requests import ClassifyRequest, RerankRequest, ScoreRequest
from batchrun.openai.responses_request import ResponsesRequest

log = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
RESPONSES_URL = "/v1/responses"
EMBEDDINGS_URL = "/v1/embeddings"
CLASSIFY_URL = "/v1/classify"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
RequestBody = ChatCompletionRequest | CompletionRequest | ResponsesRequest | EmbeddingRequest \
    | ClassifyRequest | ScoreRequest | RerankRequest
# Every endpoint batch lines, the Batches API and `serve` take, and its request body's model.
ENDPOINTS: dict[str, type[RequestBody]] = {
    CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest,
    RESPONSES_URL: ResponsesRequest, EMBEDDINGS_URL: EmbeddingRequest,
    CLASSIFY_URL: ClassifyRequest, SCORE_URL: ScoreRequest, RERANK_URL: RerankRequest}
SUPPORTED_URLS = tuple(ENDPOINTS)
# Endpoints OpenAI's Batch API takes that this runner does not serve (yet).
UNSUPPORTED_URLS = ("/v1/moderations",)
# Nesting a request body may have. orjson stops at 1024 levels without recursing; this lower
# bound keeps every later step (pydantic, Jinja's tojson, grammar compilers) far from any
# recursion limit. OpenAI's own structured-output schemas nest at most 10 levels.
MAX_BODY_DEPTH = 64


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


class BatchInputLine(StrictModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


# --- responses -------------------------------------------------------------------------------

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


def from_validation_error(exc: ValidationError, prefix: str) -> RequestError:
    """The first problem, named by its dotted path (body.messages.0.role)."""
    first = exc.errors(include_url=False)[0]
    # Tagged union members show up in loc as "str"/"list"; they mean nothing to a user.
    loc = [str(p) for p in first["loc"] if p not in ("str", "list", "strs", "ids", "ids_list")]
    path = ".".join([prefix] + loc if prefix else loc) or "(root)"
    msg = first["msg"]
    msg = msg.removeprefix("Value error, ")
    more = exc.error_count() - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    param = ".".join(loc) or None
    named = re.match(r"(\w+): ", msg)
    if param is None and named:  # a check across fields names the one to fix
        param, msg = named.group(1), msg[named.end():]
        loc = [param]
    return RequestError(f"{path}: {msg[0].lower() + msg[1:]}", code=_error_code(first["type"]),
                        param=param)


def loads(text: str | bytes) -> Any:
    """JSON text -> value: orjson, which has a nesting limit instead of recursing without one.
    Raises json.JSONDecodeError (orjson's is a subclass)."""
    return orjson.loads(text)


def json_error_message(exc: json.JSONDecodeError) -> str:  # orjson's is a subclass
    return f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})" \
        if exc.lineno > 1 else f"invalid JSON: {exc.msg} at column {exc.colno}"


def check_depth(value: Any, limit: int = MAX_BODY_DEPTH) -> None:
    """RequestError if `value` nests objects/arrays more than `limit` levels (no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise RequestError(f"body: nested more than {limit} levels deep",
                               code="invalid_value", param="body")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))


def parse_body(url: str, body: Any) -> RequestBody:
    """Validate a request body for an endpoint; raise RequestError naming the field."""
    if url in UNSUPPORTED_URLS:
        raise RequestError(f"url: the endpoint {url} is not supported by batchrun "
                           f"(supported: {', '.join(SUPPORTED_URLS)})",
                           code="unsupported_endpoint", param="url")
    if url not in SUPPORTED_URLS:
        raise RequestError(f"url: unsupported url {url!r} (supported: {', '.join(SUPPORTED_URLS)})",
                           code="invalid_url", param="url")
    model = ENDPOINTS[url]
    if isinstance(body, model):
        return body
    check_depth(body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc, "body") from None


def parse_envelope(raw: str, line_number: int) -> BatchInputLine:
    """The batch line around the body: JSON, custom_id, method, url (not yet checked), body."""
    try:
        obj = loads(raw)
    except orjson.JSONDecodeError as exc:
        # The position is reported within the line, not past its line break.
        exc = _position_in_line(raw, exc)
        raise LineError(line_number, RequestError(json_error_message(exc),
                                                  code="invalid_json")) from None
    if not isinstance(obj, dict):
        raise LineError(line_number, RequestError(
            f"expected a JSON object, got {type(obj).__name__}",
            code="invalid_json"))
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        return BatchInputLine.model_validate(obj)
    except ValidationError as exc:
        raise LineError(line_number, from_validation_error(exc, ""), custom_id) from None


def _position_in_line(raw: str, exc: orjson.JSONDecodeError) -> orjson.JSONDecodeError:
    text = raw.rstrip("\r\n")
    if exc.pos < len(text):
        return exc
    return orjson.JSONDecodeError(exc.msg, text, len(text))


def peek_custom_id(text: str | None) -> str | None:
    """The custom_id of a line as parse_envelope reads it, without validating the rest."""
    if text is None:
        return None
    try:
        obj = loads(text)
    except ValueError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def parse_batch_line(raw: str, line_number: int
                     ) -> tuple[BatchInputLine, RequestBody]:
    """Validate one input line; raise LineError naming the line and the field."""
    line = parse_envelope(raw, line_number)
    try:
        return line, parse_body(line.url, line.body)
    except RequestError as exc:
        raise LineError(line_number, exc, line.custom_id) from None
