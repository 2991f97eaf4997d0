"""POST /v1/responses: JSON or the Responses event stream, through the OpenAI adapter
(openai/serving.py maps the request onto the chat path; openai/responses.py builds the Response
and its events). Nothing is stored: there is no GET /v1/responses/{id}."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchrun.engine.async_engine import RequestStream
from batchrun.engine.errors import EngineDeadError
from batchrun.openai.wire import RESPONSES_URL
from batchrun.openai.bodies import engine_error
from batchrun.openai.prepared import PreparedRequest
from batchrun.openai.responses_events import ResponseEvents
from batchrun.server.inference_api import read_json, until_disconnected
from batchrun.server.errors import as_request_error

router = APIRouter()


@router.post(RESPONSES_URL)
async def create_response(request: Request):
    state = request.app.state.server
    body = await read_json(request)
    prepared = await asyncio.to_thread(state.serving.prepare, RESPONSES_URL, body)
    stream = state.engine.generate(f"resp-{uuid.uuid4().hex}",
                                   prepared.prompts[0], prepared.params, stream=prepared.stream,
                                   multimodal=prepared.multimodal)
    if prepared.stream:
        return StreamingResponse(_sse(prepared, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        out = await until_disconnected(request, stream.result())
    finally:
        stream.close()  # closing an unfinished stream aborts its request
    if out is None:  # the client left
        return Response(status_code=499)
    error = engine_error(out)
    if error is not None:
        raise error
    return JSONResponse(prepared.finalize(out))


def _event(obj: dict) -> str:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n"


async def _sse(prepared: PreparedRequest, stream: RequestStream) -> AsyncIterator[str]:
    events = prepared.chunks()
    assert isinstance(events, ResponseEvents)  # a Responses request streams its events
    try:
        for event in events.start():
            yield _event(event)
        async for out in stream:
            error = engine_error(out) if out.finished else None
            if error is not None:
                yield _event(events.error(error))
                return
            for event in events.update(out):
                yield _event(event)
        for event in events.end():
            yield _event(event)
    except (EngineDeadError, ValueError) as exc:
        yield _event(events.error(as_request_error(exc)))
    finally:
        stream.close()
