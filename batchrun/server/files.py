"""The Files API: uploads for batches and the batches' output files, on local disk.

Each file is `<root>/<id>` (content) plus `<root>/<id>.json` (its OpenAI file object), written
atomically, so a restarted server sees exactly the files that were fully stored.
"""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchrun.batch.storage.io import atomic_local_file
from batchrun.openai.wire import from_validation_error
from batchrun.server.errors import APIError, not_found
from batchrun.server.stored import load_objects, write_json_atomic

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch",)
# What the store reads of a stored file object; a file without them is quarantined.
FILE_FIELDS = {"id": str, "bytes": int, "created_at": int, "filename": str, "purpose": str}
# As OpenAI: uploads for batches expire after 30 days unless told otherwise; a batch's output
# files only when the batch asks (output_expires_after).
DEFAULT_UPLOAD_EXPIRY_S = {"batch": 30 * 24 * 3600}
SWEEP_INTERVAL_S = 60.0


class ExpiresAfter(BaseModel):
    """A file's expiration policy: `seconds` after its creation, between an hour and 30 days."""
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 24 * 3600)

    @classmethod
    def parse(cls, value: Any, param: str) -> "ExpiresAfter":
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            error = from_validation_error(exc, param)
            error.param = f"{param}.{error.param}" if error.param else param
            raise error from None


class FileStore:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, dict] = {}
        self._stopping = threading.Event()
        for obj in load_objects(root, "file-*.json", FILE_FIELDS):
            if (root / obj["id"]).exists():
                self._files[obj["id"]] = obj

    def _new(self, filename: str, purpose: str, size: int,
             expires_after: ExpiresAfter | None) -> dict:
        now = int(time.time())
        return {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": size,
                "created_at": now, "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None,
                "expires_at": now + expires_after.seconds if expires_after else None}

    def upload(self, src: IO[bytes], filename: str, purpose: str,
               expires_after: ExpiresAfter | None = None) -> dict:
        """Store an uploaded file (blocking I/O: call it from a worker thread)."""
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(f"purpose: {purpose!r} is not supported; this server stores files "
                           f"for the Batches API (purpose 'batch')", code="invalid_value",
                           param="purpose")
        if expires_after is None and purpose in DEFAULT_UPLOAD_EXPIRY_S:
            expires_after = ExpiresAfter(anchor="created_at",
                                         seconds=DEFAULT_UPLOAD_EXPIRY_S[purpose])
        obj = self._new(filename, purpose, 0, expires_after)
        with atomic_local_file(self.root / obj["id"]) as f:
            shutil.copyfileobj(src, f, 1 << 20)
            obj["bytes"] = f.tell()
        return self._commit(obj)

    def adopt(self, path: Path, filename: str, purpose: str,
              expires_after: ExpiresAfter | None = None) -> dict:
        """Move a finished file (a batch's output) into the store."""
        obj = self._new(filename, purpose, path.stat().st_size, expires_after)
        os.replace(path, self.root / obj["id"])
        return self._commit(obj)

    def _commit(self, obj: dict) -> dict:
        write_json_atomic(self.root / f"{obj['id']}.json", obj)
        with self._lock:
            self._files[obj["id"]] = obj
        return dict(obj)

    def get(self, file_id: str) -> dict:
        self.delete_expired()
        with self._lock:
            obj = self._files.get(file_id)
        if obj is None:
            raise not_found("file", file_id, "file_id")
        return dict(obj)

    def path(self, file_id: str) -> Path:
        self.get(file_id)
        return self.root / file_id

    def list(self, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> tuple[list[dict], bool]:
        self.delete_expired()
        with self._lock:
            files = [dict(f) for f in self._files.values()
                     if purpose is None or f["purpose"] == purpose]
        files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=order == "desc")
        if after is not None:
            ids = [f["id"] for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        return files[:limit], len(files) > limit

    def delete(self, file_id: str) -> dict:
        with self._lock:
            obj = self._files.pop(file_id, None)
        if obj is None:
            raise not_found("file", file_id, "file_id")
        self._remove(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def delete_expired(self, now: float | None = None) -> builtins.list[str]:  # list: a method here
        """Delete the files whose expires_at has passed (an expired file is gone: retrieving it
        is a 404, as on OpenAI); returns their ids."""
        now = time.time() if now is None else now
        with self._lock:
            expired = [i for i, f in self._files.items()
                       if f.get("expires_at") is not None and f["expires_at"] <= now]
            for file_id in expired:
                del self._files[file_id]
        for file_id in expired:
            self._remove(file_id)
        return expired

    def start(self) -> None:
        """Delete expired files every SWEEP_INTERVAL_S, also those nobody asks for."""
        def sweep() -> None:
            while not self._stopping.wait(SWEEP_INTERVAL_S):
                try:
                    self.delete_expired()
                except OSError:
                    log.exception("could not delete expired files")

        self.delete_expired()
        threading.Thread(target=sweep, name="batchrun-file-expiry", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()

    def _remove(self, file_id: str) -> None:
        for p in (self.root / f"{file_id}.json", self.root / file_id):
            p.unlink(missing_ok=True)
