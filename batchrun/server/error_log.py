"""Logs every 4xx answer on one line, so an operator sees what clients get wrong:

    POST /v1/chat/completions 400 invalid_value param=temperature: temperature: ...

The line comes from the error response (code, param, message), never from the request body.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)

MAX_CAPTURED = 8192  # error bodies are small; a larger 4xx body is logged without its details
MAX_MESSAGE = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ClientErrorLogMiddleware:
    """Pure ASGI: reads along the response, so a 2xx stream passes through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None
        body = bytearray()

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and _client_error(status) \
                    and len(body) <= MAX_CAPTURED:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if _client_error(status):
                log.info("%s", _line(scope, status, bytes(body)))


def _client_error(status: int | None) -> bool:
    return status is not None and 400 <= status < 500


def _line(scope, status: int, body: bytes) -> str:
    head = f"{scope['method']} {_one_line(scope['path'])} {status}"
    try:
        error = json.loads(body)["error"]
        code, param, message = error["code"], error["param"], str(error["message"])
    except (ValueError, TypeError, KeyError):
        return head
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return f"{head} {code or '-'} param={_one_line(str(param or '-'))}: {_one_line(message)}"


def _one_line(text: str) -> str:
    """Control characters escaped: a client's text must not forge or break log lines."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
