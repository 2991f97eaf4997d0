"""ASGI middleware in front of every route: API key, request body size, HTTP metrics."""

from __future__ import annotations

import json
import secrets
import time

from batchrun.server.metrics import ServerMetrics

# What answers without the API key: probes and monitoring. Everything else wants it, the API
# docs (/docs, /redoc, /openapi.json) and routes added later included.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class _BodyTooLarge(Exception):
    pass


def _error(status: int, message: str, type_: str, code: str) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return status, json.dumps(body).encode()


class GuardMiddleware:
    """Pure ASGI (no per-request task or buffering), so streamed responses pass straight through."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, max_upload_bytes: int,
                 metrics: ServerMetrics | None = None):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status_seen = {"status": 500, "started": False}
        started = time.perf_counter()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
                status_seen["started"] = True
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await _send_json(send_wrapper, *refusal)
                return
            limit = self._limit(scope)
            await self.app(scope, _limited(receive, limit), send_wrapper)
        except _BodyTooLarge:
            if not status_seen["started"]:
                await _send_json(send_wrapper, *self._too_large(scope))
        finally:
            if self.metrics is not None:
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                self.metrics.record_http(scope["method"], path, status_seen["status"],
                                         time.perf_counter() - started)

    def _refusal(self, scope) -> tuple[int, bytes] | None:
        path = scope["path"]
        if self.api_key and path not in OPEN_PATHS:
            if not self._authorized(scope):
                return _error(401, "Incorrect API key provided. Pass it as "
                                   "'Authorization: Bearer <key>'.",
                              "invalid_request_error", "invalid_api_key")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self._limit(scope):
            return self._too_large(scope)
        return None

    def _authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            token = _header(scope, b"x-api-key") or ""
        assert self.api_key is not None  # checked only when a key is set
        return secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    def _limit(self, scope) -> int:
        return self.max_upload_bytes if scope["path"] == "/v1/files" else self.max_body_bytes

    def _too_large(self, scope) -> tuple[int, bytes]:
        return _error(413, f"The request body is larger than the server's limit of "
                           f"{self._limit(scope)} bytes.", "invalid_request_error",
                      "request_too_large")


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _limited(receive, limit: int):
    """receive() that counts body bytes (chunked uploads carry no content-length)."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge()
        return message

    return wrapped


async def _send_json(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
