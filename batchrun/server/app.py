"""The FastAPI application: OpenAI-compatible routes on one shared engine.

    /v1/chat/completions  /v1/completions  /v1/responses  /v1/embeddings  /v1/models
    /v1/classify  /v1/score  /v1/rerank                              (vLLM's pooling endpoints)
    /v1/files...  /v1/batches...                                     (API key when set)
    /docs  /redoc  /openapi.json                                     (API key when set)
    /health  /metrics  /version
"""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from batchrun import __version__
from batchrun.server import batches_api, files_api, inference_api, responses_api
from batchrun.server.error_log import ClientErrorLogMiddleware
from batchrun.server.errors import install_handlers, not_found
from batchrun.server.middleware import GuardMiddleware
from batchrun.server.state import ServerState

info = APIRouter()


@info.get("/health")
async def health(request: Request):
    engine = request.app.state.server.engine
    if not engine.is_alive:
        reason = repr(engine.dead) if engine.dead is not None else "the engine is not running"
        return JSONResponse({"status": "error", "detail": reason}, status_code=503)
    return {"status": "ok"}


@info.get("/version")
async def version():
    return {"version": __version__}


@info.get("/metrics")
async def metrics(request: Request):
    metrics = request.app.state.server.metrics
    return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)


def _model_card(state: ServerState, name: str) -> dict:
    """The base model's card, or a LoRA adapter's: `parent` names its base (as vLLM's)."""
    adapters = state.lora_paths
    return {"id": name, "object": "model", "created": state.created, "owned_by": "batchrun",
            "root": adapters[name] if name in adapters else str(state.model.path or state.model.name),
            "parent": state.served_name if name in adapters else None,
            "max_model_len": state.model.max_model_len}


@info.get("/v1/models")
async def list_models(request: Request):
    state = request.app.state.server
    return {"object": "list", "data": [_model_card(state, name)
                                       for name in (state.served_name, *state.lora_paths)]}


@info.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str):
    state = request.app.state.server
    if model_id in state.lora_paths:
        return _model_card(state, model_id)
    if model_id != state.served_name and model_id not in state.model_aliases:
        raise not_found("model", model_id, "model")
    return _model_card(state, state.served_name)


def create_app(state: ServerState, manage_state: bool = True) -> FastAPI:
    """The app over `state`. With manage_state, the app's lifespan starts the engine thread and
    the batch workers and stops them on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if manage_state:
            state.start()
        try:
            yield
        finally:
            if manage_state:
                state.stop()

    app = FastAPI(title="batchrun", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_handlers(app)
    for router in (info, inference_api.router, files_api.router, batches_api.router):
        app.include_router(router)
    app.include_router(responses_api.router)
    cfg = state.config
    app.add_middleware(GuardMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_size,
                       max_upload_bytes=cfg.max_upload_size, metrics=state.metrics)
    app.add_middleware(ClientErrorLogMiddleware)  # added last: outside the guard, sees its 401s
    return app
