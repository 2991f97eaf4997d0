"""POST /v1/chat/completions, /v1/completions, /v1/embeddings and vLLM's pooling endpoints
(/v1/classify, /v1/score, /v1/rerank): JSON or SSE, through the OpenAI adapter that batch lines
use (openai/serving.py): prepare -> engine -> finalize, or chunks for a stream. Every endpoint of
openai.wire.ENDPOINTS but /v1/responses (responses_api.py) is routed here."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchrun.engine.async_engine import RequestStream
from batchrun.engine.errors import EngineDeadError
from batchrun.engine.outputs import RequestOutput
from batchrun.openai.wire import ENDPOINTS, RESPONSES_URL, RequestError
from batchrun.openai.bodies import completion_id, engine_error, error_body
from batchrun.openai.completions import CompletionChunks
from batchrun.openai.prepared import PreparedRequest
from batchrun.server.errors import as_request_error

router = APIRouter()


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object. orjson, not json: it stops at 1024 levels of nesting where the
    stdlib parser raises RecursionError, and it refuses NaN, Infinity and non-UTF-8 text."""
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") \
            from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    return body


def _route(url: str):
    async def endpoint(request: Request):
        return await _serve(request, url)

    endpoint.__name__ = "create_" + url.rsplit("/", 1)[-1].replace("/", "_")
    return endpoint


for _url in ENDPOINTS:
    if _url != RESPONSES_URL:
        router.post(_url)(_route(_url))


async def _serve(request: Request, url: str):
    state = request.app.state.server
    body = await read_json(request)
    # Chat templates and tokenizers take real time on long conversations: keep them off the loop.
    prepared = await asyncio.to_thread(state.serving.prepare, url, body)
    _check_fits_queue(prepared, state.config.max_queued_requests)
    base = completion_id("chat" if prepared.kind == "chat" else "text")
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prepared.prompts):
            streams.append(state.engine.generate(f"{base}-{i}", prompt, prepared.params,
                                                 stream=prepared.stream,
                                                 multimodal=prepared.multimodal))
    except BaseException:
        for s in streams:
            s.close()
        raise
    if prepared.stream:
        return StreamingResponse(_sse(prepared, streams), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        outs = await until_disconnected(request, asyncio.gather(*(s.result() for s in streams)))
    finally:
        for s in streams:  # closing unfinished streams aborts their requests
            s.close()
    if outs is None:  # the client left
        return Response(status_code=499)
    for out in outs:
        error = engine_error(out)
        if error is not None:
            raise error
    return JSONResponse(prepared.finalize(outs))


def _check_fits_queue(prepared: PreparedRequest, limit: int) -> None:
    """A 400 for a request of more prompts (each an engine request) than --max-queued-requests
    lets in at once: a 429 would tell its client to retry what can never fit."""
    if len(prepared.prompts) > limit:
        field = prepared.prompts_param
        raise RequestError(f"{field}: {len(prepared.prompts)} prompts in one request, but this "
                           f"server runs at most {limit} requests at once "
                           f"(--max-queued-requests); send fewer per request",
                           code="invalid_value", param=field)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(prepared: PreparedRequest, streams: list[RequestStream]) -> AsyncIterator[str]:
    # Starlette cancels this generator when the client disconnects; leaving it closes the
    # streams, which aborts their engine requests and frees their KV blocks.
    chunks = prepared.chunks()
    try:
        for chunk in chunks.start():
            yield _event(chunk)
        async for i, out in _merged(streams):
            error = engine_error(out) if out.finished else None
            if error is not None:
                yield _event(error_body(error))
                break
            for chunk in chunks.update(out, i) if isinstance(chunks, CompletionChunks) \
                    else chunks.update(out):
                yield _event(chunk)
        else:
            for chunk in chunks.end():
                yield _event(chunk)
    except (EngineDeadError, ValueError) as exc:
        yield _event(error_body(as_request_error(exc)))
    finally:
        for s in streams:
            s.close()
    yield "data: [DONE]\n\n"


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come (completions with a list of
    prompts); one stream is read directly."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                open_streams -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request, work):
    """Await `work` unless the client disconnects first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
