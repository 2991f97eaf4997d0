"""Every error the server answers, in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from typing import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from batchrun.engine.errors import EngineDeadError, QueueFullError
from batchrun.openai.wire import RequestError
from batchrun.openai.bodies import error_body

log = logging.getLogger(__name__)


class APIError(RequestError):
    """RequestError with HTTP-only defaults (404s, 401s, ...)."""


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    return APIError(f"No {what} found with id '{ident}'.", code="not_found", param=param,
                    status_code=404)


def error_response(error: RequestError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status_code, headers=headers)


def as_request_error(exc: BaseException) -> RequestError:
    """The API error for an exception a handler let through."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, QueueFullError):
        return RequestError(str(exc), code="queue_full", type="server_busy", status_code=429)
    if isinstance(exc, EngineDeadError):
        return RequestError(str(exc), code="engine_dead", type="server_error", status_code=503)
    if isinstance(exc, ClientDisconnect):  # it left (or was timed out) while sending the body
        return RequestError("the client disconnected before sending the whole request",
                            code="client_disconnected", status_code=499)
    if isinstance(exc, ValueError):  # the engine's own refusals (prompt too long, ...)
        return RequestError(str(exc), code="invalid_value")
    log.exception("unhandled error", exc_info=exc)
    return RequestError("internal server error", code="internal_error", type="server_error",
                        status_code=500)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return error_response(exc)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError):
        return error_response(as_request_error(exc), headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        return error_response(as_request_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(RequestError(str(exc.detail), code=code,
                                           status_code=exc.status_code), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg")
        return error_response(RequestError(msg, code="invalid_value", param=param))

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception):
        return error_response(as_request_error(exc))
