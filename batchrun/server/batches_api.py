"""Routes of the Batches API: /v1/batches."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from batchrun.server.inference_api import read_json

router = APIRouter()


def _manager(request: Request):
    return request.app.state.server.batches


@router.post("/v1/batches")
async def create_batch(request: Request):
    return _manager(request).create(await read_json(request))


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100),
                       after: str | None = None):
    batches, more = _manager(request).list(limit, after)
    return {"object": "list", "data": batches, "has_more": more,
            "first_id": batches[0]["id"] if batches else None,
            "last_id": batches[-1]["id"] if batches else None}


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str):
    return _manager(request).get(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    return _manager(request).cancel(batch_id)
