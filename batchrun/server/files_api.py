"""Routes of the Files API: /v1/files."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from batchrun.server.errors import APIError
from batchrun.server.files import ExpiresAfter

router = APIRouter()


def _store(request: Request):
    return request.app.state.server.files


@router.post("/v1/files")
async def upload_file(request: Request):
    # The form is parsed here rather than by FastAPI, so a body over the size limit reaches the
    # size-limit middleware instead of becoming a generic "error parsing the body".
    async with request.form(max_files=1, max_fields=10) as form:
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise APIError("file: a multipart file field named 'file' is required",
                           code="missing_required_parameter", param="file")
        if not isinstance(purpose, str):
            raise APIError("purpose: a form field 'purpose' is required",
                           code="missing_required_parameter", param="purpose")
        expires_after = _expires_after(form)
        return await asyncio.to_thread(_store(request).upload, file.file,
                                       file.filename or "upload.jsonl", purpose, expires_after)


def _expires_after(form) -> ExpiresAfter | None:
    """The optional expires_after policy; the openai client sends it as the form fields
    `expires_after[anchor]` and `expires_after[seconds]`."""
    fields = {key[len("expires_after["):-1]: value for key, value in form.multi_items()
              if key.startswith("expires_after[") and key.endswith("]")}
    if not fields:
        return None
    if isinstance(fields.get("seconds"), str) and fields["seconds"].strip().isdigit():
        fields["seconds"] = int(fields["seconds"])
    return ExpiresAfter.parse(fields, "expires_after")


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000), after: str | None = None,
                     order: Literal["asc", "desc"] = "desc"):
    files, more = _store(request).list(purpose, limit, after, order)
    return {"object": "list", "data": files, "has_more": more,
            "first_id": files[0]["id"] if files else None,
            "last_id": files[-1]["id"] if files else None}


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str):
    return _store(request).get(file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    store = _store(request)
    obj = store.get(file_id)
    return FileResponse(store.path(file_id), media_type="application/octet-stream",
                        filename=obj["filename"])


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    return _store(request).delete(file_id)
