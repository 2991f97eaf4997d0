"""The Response object of /v1/responses from a finished chat result: its output items
(reasoning, message, function_call), usage and the request's settings echoed."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchrun.engine.outputs import RequestOutput
from batchrun.openai.chat import ChatFormatter
from batchrun.openai.responses_request import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
            items.append(reasoning_item(item_id("rs"), message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            items.append(message_item(item_id("msg"), message.get("content") or "", "completed"))
        for call in calls:
            items.append(call_item(item_id("fc"), call["id"], call["function"]["name"],
                                   call["function"]["arguments"], "completed"))
        items[-1]["status"] = status  # as in the stream: only the item cut short is incomplete
        return self.response(item_id("resp"), chat["created"], status, items,
                             response_usage(chat["usage"]))
