"""The Files API: uploads for batches and the batches' output files, on local disk.

Each file is `<root>/<id>` (content) plus `<root>/<id>.json` (its OpenAI file object), written
atomically, so a restarted server sees exactly the files that were fully stored.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import IO

from batchrun.batch.io import atomic_local_file
from batchrun.server.errors import APIError, not_found
from batchrun.server.stored import load_objects, write_json_atomic

UPLOAD_PURPOSES = ("batch",)
# What the store reads of a stored file object; a file without them is quarantined.
FILE_FIELDS = {"id": str, "bytes": int, "created_at": int, "filename": str, "purpose": str}


class FileStore:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, dict] = {}
        for obj in load_objects(root, "file-*.json", FILE_FIELDS):
            if (root / obj["id"]).exists():
                self._files[obj["id"]] = obj

    def _new(self, filename: str, purpose: str, size: int) -> dict:
        return {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": size,
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None, "expires_at": None}

    def upload(self, src: IO[bytes], filename: str, purpose: str) -> dict:
        """Store an uploaded file (blocking I/O: call it from a worker thread)."""
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(f"purpose: {purpose!r} is not supported; this server stores files "
                           f"for the Batches API (purpose 'batch')", code="invalid_value",
                           param="purpose")
        obj = self._new(filename, purpose, 0)
        with atomic_local_file(self.root / obj["id"]) as f:
            shutil.copyfileobj(src, f, 1 << 20)
            obj["bytes"] = f.tell()
        return self._commit(obj)

    def adopt(self, path: Path, filename: str, purpose: str) -> dict:
        """Move a finished file (a batch's output) into the store."""
        obj = self._new(filename, purpose, path.stat().st_size)
        os.replace(path, self.root / obj["id"])
        return self._commit(obj)

    def _commit(self, obj: dict) -> dict:
        write_json_atomic(self.root / f"{obj['id']}.json", obj)
        with self._lock:
            self._files[obj["id"]] = obj
        return dict(obj)

    def get(self, file_id: str) -> dict:
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
        for p in (self.root / f"{file_id}.json", self.root / file_id):
            p.unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}
