"""/v1/responses on the chat path: a Responses request becomes a chat request (rendered, parsed
and constrained exactly as /v1/chat/completions is), and the chat result or stream becomes a
`response` object or the Responses event stream.

    chat = to_chat_request(request)                      # RequestError naming the Responses field
    prepared = prepare_response(request, serving._chat)  # the chat PreparedRequest, re-dressed
    prepared.finalize(output)                            # {"object": "response", ...}
    events = prepared.chunks(); events.start(); events.update(out); events.end()

What is left out, as 400s naming the field: previous_response_id / conversation / prompt
(batchrun stores nothing), background, built-in tools (web_search, file_search, computer use,
...), item_reference inputs, image / file / audio inputs. `store` is accepted either way and
nothing is stored: every Response says `store: false`. Reasoning items given back as input are
dropped (a chat template shows earlier turns without their thoughts).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import ValidationError

from batchrun.engine.outputs import RequestOutput
from batchrun.openai.chat import ChatChunks, ChatFormatter
from batchrun.openai.protocol import RequestError, from_validation_error
from batchrun.openai.requests import ChatCompletionRequest
from batchrun.openai.responses_request import ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(f"{param}: {message}", code=code, param=param)


# --- request -> chat request ------------------------------------------------------------------

def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise _bad(where, "a content part must be an object", "invalid_type")
    kind = part.get("type")
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text", "a text part needs a 'text' string", "invalid_type")
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind in ("input_image", "input_file", "input_audio"):
        raise _bad(f"{where}.type", f"{kind} inputs are not supported (text only)",
                   "unsupported_value")
    raise _bad(f"{where}.type", f"unknown content part type {kind!r}")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p, f"{where}.{j}") for j, p in enumerate(content))
    raise _bad(where, "content must be a string or an array of content parts", "invalid_type")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", f"a string is required", "missing_required_parameter"
                   if value is None else "invalid_type")
    return value


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    for i, item in enumerate(request.input):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            messages.append({"role": role,
                             "content": _content(item.get("content"), f"{where}.content")})
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
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _content(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
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
    schema = {"name": fmt.name, "schema": fmt.json_schema}
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
        raise responses_error(exc) from None
    prepared.kind = "response"
    prepared.formatter = ResponseFormatter(prepared.formatter, request,
                                           prepared.params.temperature, prepared.params.top_p)
    return prepared


# --- chat result -> response ------------------------------------------------------------------

def _echo_tools(request: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")}
            for t in request.tools or []]


def _echo_text(request: ResponsesRequest) -> dict[str, Any]:
    fmt = request.text.format if request.text else None
    if fmt is None or fmt.type != "json_schema":
        return {"format": {"type": fmt.type if fmt else "text"}}
    return {"format": {"type": "json_schema", "name": fmt.name, "schema": fmt.json_schema,
                       "description": fmt.description, "strict": fmt.strict}}


def response_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            # cache_write_tokens (newer clients require it): OpenAI's billed cache writes;
            # batchrun's prefix cache bills nothing, so 0.
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(id_: str, text: str, status: str) -> dict[str, Any]:
    return {"id": id_, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(id_: str, text: str, status: str) -> dict[str, Any]:
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": id_, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@dataclass
class ResponseFormatter:
    """Wraps the request's ChatFormatter: the same parse, a Response body."""
    chat: ChatFormatter
    request: ResponsesRequest
    temperature: float | None = None  # what the engine samples with, echoed
    top_p: float | None = None

    def response(self, id_: str, created: int, status: str, output: list[dict],
                 usage: dict | None, finish: str | None = None) -> dict[str, Any]:
        r = self.request
        incomplete = status == "incomplete"
        return {
            "id": id_, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.chat.model_name, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": r.reasoning.effort, "summary": r.reasoning.summary}
            if r.reasoning else None,
            "store": False, "background": False,
            "temperature": self.temperature if r.temperature is None else r.temperature,
            "top_p": self.top_p if r.top_p is None else r.top_p,
            "text": _echo_text(r),
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": _echo_tools(r), "truncation": "disabled",
            "usage": usage, "user": r.user, "metadata": r.metadata or {},
        }

    def body(self, output: RequestOutput, created: int | None = None) -> dict[str, Any]:
        chat = self.chat.body(output, created)
        (choice,) = chat["choices"]
        message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        items: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            items.append(reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            items.append(message_item(_id("msg"), message.get("content") or "", "completed"))
        for call in calls:
            items.append(call_item(_id("fc"), call["id"], call["function"]["name"],
                                   call["function"]["arguments"], "completed"))
        items[-1]["status"] = status  # as in the stream: only the item cut short is incomplete
        return self.response(_id("resp"), chat["created"], status, items,
                             response_usage(chat["usage"]))

    def stream(self, n: int, include_usage: bool = False,
               continuous_usage: bool = False) -> "ResponseEvents":
        return ResponseEvents(self, self.chat.stream(1, True, False))


# --- chat chunks -> response events -----------------------------------------------------------

@dataclass
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # output_index
    id: str
    text: str = ""  # the text, or a call's arguments
    call_id: str = ""
    name: str = ""


@dataclass
class ResponseEvents:
    """The Responses event stream from the chat adapter's chunks: start(), update(out), end().
    Every event carries a sequence_number; the last is response.completed or
    response.incomplete with the whole Response."""
    fmt: ResponseFormatter
    chunks: ChatChunks
    id: str = field(default_factory=lambda: _id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)  # finished items
    current: _Item | None = None
    calls: dict[int, _Item] = field(default_factory=dict)  # chat tool-call index -> item
    done: bool = False

    def _event(self, type_: str, **fields) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self, status: str, usage: dict | None = None) -> dict[str, Any]:
        return self.fmt.response(self.id, self.created, status, list(self.output), usage)

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def _item(self, item: _Item, status: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return reasoning_item(item.id, item.text, status)
        if item.kind == "message":
            return message_item(item.id, item.text, status)
        return call_item(item.id, item.call_id, item.name, item.text, status)

    def _open(self, kind: str, **fields) -> list[dict]:
        events = self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, len(self.output), _id(prefix), **fields)
        self.current = item
        added = self._item(item, "in_progress")
        if kind == "message":
            added["content"] = []
        events.append(self._event("response.output_item.added", output_index=item.index,
                                  item=added))
        if kind != "function_call":
            events.append(self._event("response.content_part.added", **self._where(item),
                                      part=self._part(item, "")))
        return events

    @staticmethod
    def _where(item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    @staticmethod
    def _part(item: _Item, text: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self, status: str) -> list[dict]:
        item, self.current = self.current, None
        if item is None:
            return []
        events = []
        if item.kind == "message":
            events += [self._event("response.output_text.done", **self._where(item),
                                   text=item.text, logprobs=[]),
                       self._event("response.content_part.done", **self._where(item),
                                   part=self._part(item, item.text))]
        elif item.kind == "reasoning":
            events += [self._event("response.reasoning_text.done", **self._where(item),
                                   text=item.text),
                       self._event("response.content_part.done", **self._where(item),
                                   part=self._part(item, item.text))]
        else:
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item.id, output_index=item.index,
                                      name=item.name, arguments=item.text))
        done = self._item(item, status)
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=item.index,
                                  item=done))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.current is None or self.current.kind != kind:
            events += self._open(kind)
        item = self.current
        item.text += text
        name = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, **self._where(item), delta=text, **extra))
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict]:
        events = []
        fn = delta.get("function") or {}
        item = self.calls.get(delta["index"])
        if item is None:
            events += self._open("function_call", call_id=delta.get("id") or "",
                                 name=fn.get("name") or "")
            item = self.calls[delta["index"]] = self.current
        if fn.get("arguments"):
            item.text += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item.id, output_index=item.index,
                                      delta=fn["arguments"]))
        return events

    def update(self, output: RequestOutput) -> list[dict]:
        if self.done:
            return []
        events = []
        for chunk in self.chunks.update(output):
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    events += self._text("reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    events += self._text("message", delta["content"])
                for call in delta.get("tool_calls") or []:
                    events += self._call(call)
                if choice["finish_reason"] is not None:
                    events += self._finish(choice["finish_reason"])
        return events

    def _finish(self, reason: str) -> list[dict]:
        self.done = True
        status = "incomplete" if reason == "length" else "completed"
        events = []
        if not self.output and self.current is None:  # nothing said: an empty message
            events += self._open("message")
        events += self._close(status)
        usage = response_usage(self.chunks.usage())
        events.append(self._event(f"response.{status}",
                                  response=self._snapshot(status, usage)))
        return events

    def end(self) -> list[dict]:
        return []

    def error(self, error: RequestError) -> dict[str, Any]:
        """The `error` event for a request that failed mid-stream."""
        self.done = True
        return self._event("error", code=error.code, message=error.message, param=error.param)
