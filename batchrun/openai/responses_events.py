"""The Responses event stream of /v1/responses, made from the chat adapter's stream chunks:
response.created, output_item.added, the text / reasoning / call-argument deltas and dones,
output_item.done, then response.completed (or incomplete) with the whole Response."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.outputs import RequestOutput
from batchrun.openai.chat import ChatChunks
from batchrun.openai.wire import RequestError
from batchrun.openai.responses_body import (ResponseFormatter, call_item, item_id,
                                            message_item, reasoning_item, response_usage)


@dataclass
class StreamingResponseFormatter(ResponseFormatter):
    """A ResponseFormatter that also streams: the formatter a Responses request is prepared with."""

    def stream(self, n: int, include_usage: bool = False,
               continuous_usage: bool = False) -> "ResponseEvents":
        return ResponseEvents(self, self.chat.stream(1, True, False))


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
    id: str = field(default_factory=lambda: item_id("resp"))
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
        item = _Item(kind, len(self.output), item_id(prefix), **fields)
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
        assert item is not None  # _open made it
        item.text += text
        name = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        extra: dict[str, list] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, **self._where(item), delta=text, **extra))
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict]:
        events = []
        fn = delta.get("function") or {}
        item = self.calls.get(delta["index"])
        if item is None:
            events += self._open("function_call", call_id=delta.get("id") or "",
                                 name=fn.get("name") or "")
            item = self.current
            assert item is not None  # _open made it
            self.calls[delta["index"]] = item
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
