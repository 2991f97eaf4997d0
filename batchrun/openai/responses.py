"""/v1/responses on the chat path: a Responses request becomes a chat request (rendered, parsed
and constrained exactly as /v1/chat/completions is), and the chat result or stream becomes a
`response` object (responses_body.py) or the Responses event stream (responses_events.py).
This module maps the request.

    chat = to_chat_request(request)                      # RequestError naming the Responses field
    prepared = prepare_response(request, serving._chat)  # the chat PreparedRequest, re-dressed
    prepared.finalize(output)                            # {"object": "response", ...}
    events = prepared.chunks(); events.start(); events.update(out); events.end()

What is left out, as 400s naming the field: previous_response_id / conversation / prompt
(batchrun stores nothing), background, built-in tools (web_search, file_search, computer use,
...), item_reference inputs, file / audio inputs (input_image items become image parts
for a vision-language model). `store` is accepted either way and
nothing is stored: every Response says `store: false`. Reasoning items given back as input are
dropped (a chat template shows earlier turns without their thoughts).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from pydantic import ValidationError

from batchrun.openai.wire import RequestError, from_validation_error
from batchrun.openai.requests import ChatCompletionRequest
from batchrun.openai.responses_events import StreamingResponseFormatter
from batchrun.openai.responses_request import ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def _bad(param: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(f"{param}: {message}", code=code, param=param)


# --- request -> chat request ------------------------------------------------------------------

def _part_text(part: Any, where: str) -> str | dict[str, Any]:
    """A text part's text; an input_image part as a chat image_url part."""
    if not isinstance(part, dict):
        raise _bad(where, "a content part must be an object", "invalid_type")
    kind = part.get("type")
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text", "a text part needs a 'text' string", "invalid_type")
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise _bad(f"{where}.image_url", "an input_image needs an image_url string (a URL "
                       "or a data: URL; file_id needs stored files)", "invalid_value")
        image = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind in ("input_file", "input_audio"):
        raise _bad(f"{where}.type", f"{kind} inputs are not supported (text only)",
                   "unsupported_value")
    raise _bad(f"{where}.type", f"unknown content part type {kind!r}")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """The chat content: the text, or with input_image parts a list of text and image_url parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [_part_text(p, f"{where}.{j}") for j, p in enumerate(content)]
        texts = [p for p in parts if isinstance(p, str)]
        if len(texts) == len(parts):
            return "".join(texts)
        return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    raise _bad(where, "content must be a string or an array of content parts", "invalid_type")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", f"a string is required", "missing_required_parameter"
                   if value is None else "invalid_type")
    return value


def _messages(request: ResponsesRequest,
              origins: list[str | None] | None = None) -> list[dict[str, Any]]:
    """The chat messages; `origins` (when given) gets the input item each one comes from."""
    messages: list[dict[str, Any]] = []
    if origins is None:
        origins = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
        origins.append(None)
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    thought: list[str] = []  # reasoning items' text, for the assistant turn they precede
    for i, item in enumerate(request.input):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            messages.append({"role": role,
                             "content": _content(item.get("content"), f"{where}.content")})
            origins.append(where)
            if role == "assistant":
                _attach(messages[-1], thought)
            thought = []
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # the text and the calls of one model turn are one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(None)
            _attach(messages[-1], thought)
            thought = []
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _content(item.get("output"), f"{where}.output")})
            origins.append(None)
        elif kind == "reasoning":  # the chain of thought of the turn that follows
            thought += [part["text"] for part in item.get("content") or []
                        if isinstance(part, dict) and part.get("type") == "reasoning_text"
                        and isinstance(part.get("text"), str)]
            continue
        elif kind == "item_reference":
            raise _bad(f"{where}.type", "item_reference needs stored responses, which batchrun "
                       "does not keep", "unsupported_value")
        else:
            raise _bad(f"{where}.type", f"input items of type {kind!r} are not supported "
                       "(message, function_call, function_call_output, reasoning)",
                       "unsupported_value")
    if not any(m["role"] != "system" for m in messages):
        raise _bad("input", "needs at least one message that is not a system message")
    return messages


def _attach(turn: dict[str, Any], thought: list[str]) -> None:
    """Reasoning items' text as the assistant turn's reasoning_content (what a chat request's
    earlier turn carries; render.py passes it on under the name the template reads)."""
    if thought and "reasoning_content" not in turn:
        turn["reasoning_content"] = "\n".join(thought)


def _tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    if request.tools is None:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"tools.{i}.type", f"built-in tool {kind!r} is not supported (only "
                       "function tools)", "unsupported_value")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise _bad("tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported "
                   "(\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\"})",
                   "unsupported_value")
    if not isinstance(choice.get("name"), str):
        raise _bad("tool_choice.name", "a string is required", "missing_required_parameter")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    fmt = request.text.format if request.text else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


# The chat request's names for what the Responses request calls otherwise.
_RENAMES = [
    (re.compile(r"^tools\.(\d+)\.function\b"), r"tools.\1"),
    (re.compile(r"^response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"^response_format\.json_schema\b"), "text.format"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^max_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"^messages(\.\d+)?\b"), "input"),
    (re.compile(r"^tool_choice\.function\b"), "tool_choice"),
]


def _rename(param: str) -> str:
    for pattern, repl in _RENAMES:
        param, n = pattern.subn(repl, param)
        if n:
            break
    return param


def responses_error(exc: RequestError) -> RequestError:
    """A chat-path error, re-worded in the Responses request's field names."""
    if not exc.param:
        return exc
    new = _rename(exc.param)
    if new == exc.param:
        return exc
    message = exc.message
    for prefix in ("body.", ""):
        if message.startswith(prefix + exc.param):
            message = prefix + new + message[len(prefix + exc.param):]
            break
    return RequestError(message, code=exc.code, param=new, type=exc.type,
                        status_code=exc.status_code)


_PART_PARAM = re.compile(r"^messages\.(\d+)\.content\.(\d+)(\.image_url)?(\.url|\.detail)?$")


def content_part_error(exc: RequestError, request: ResponsesRequest) -> RequestError | None:
    """A content part's error named by its Responses input item: an input_image's
    (input.I.content.J.image_url), or a part the model cannot take (input.I.content.J.type)."""
    match = _PART_PARAM.match(exc.param or "")
    if match is None or isinstance(request.input, str):
        return None
    origins: list[str | None] = []
    _messages(request, origins)
    origin = origins[int(match.group(1))]
    if origin is None:
        return None
    part = f"{origin}.content.{match.group(2)}"
    new = f"{part}.detail" if match.group(4) == ".detail" else \
        f"{part}.image_url" if match.group(3) else f"{part}.type"
    message = exc.message.replace(exc.param or "", new, 1)  # a param matched _PART_PARAM
    return RequestError(message, code=exc.code, param=new, type=exc.type,
                        status_code=exc.status_code)


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request the Responses request means; RequestError naming the Responses field."""
    body: dict[str, Any] = {"messages": _messages(request), "n": 1, "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "metadata", "user"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort  # to the template, as chat's
    tools = _tools(request)
    if tools is not None:
        body["tools"] = tools
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    fmt = _response_format(request)
    if fmt is not None:
        body["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise responses_error(from_validation_error(exc, "body")) from None


def prepare_response(request: ResponsesRequest, prepare_chat: Callable, reasoning: Any):
    """The chat adapter's PreparedRequest for `request`, answering as /v1/responses does.
    `prepare_chat` is OpenAIServing._chat; `reasoning` its reasoning parser (or None)."""
    effort = request.reasoning.effort if request.reasoning else None
    if effort not in (None, "none") and reasoning is None:
        raise _bad("reasoning.effort", "this model has no reasoning parser (run with "
                   "--reasoning-parser for a model that thinks)", "unsupported_value")
    try:
        prepared = prepare_chat(to_chat_request(request))
    except RequestError as exc:
        raise content_part_error(exc, request) or responses_error(exc) from None
    prepared.kind = "response"
    params = prepared.params
    prepared.formatter = StreamingResponseFormatter(prepared.formatter, request,
                                                    params.temperature, params.top_p)
    return prepared
