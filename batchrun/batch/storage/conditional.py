"""Compare-and-swap on one small object, on every store that has it: create only if absent,
replace or delete only if unchanged since read. What an exclusive lease needs.

  local  create: the content written to a temp file, then os.link (fails if the name exists:
         O_EXCL's guarantee, with the content whole when it appears); replace/delete: under an
         flock of the file, its content compared first. The token is the content's sha256.
         A symbolic link at the name is never followed (io.LinkRefused).
  s3     PUT with If-None-Match: * (create) or If-Match: ETAG (replace), DELETE with If-Match;
         the token is the ETag. (AWS S3 since 2024, MinIO, R2, moto.)
  gs     uploads with ifGenerationMatch=0 (create) or =GENERATION (replace), DELETE with
         ifGenerationMatch; the token is the generation.
  other  no atomic primitive: best effort (exists check, write, read back), said in a warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from batchrun.batch.storage import io

log = logging.getLogger("batchrun.batch")


@dataclass(frozen=True)
class Versioned:
    data: bytes
    token: str  # what replace/delete compare against


class ConditionalObject:
    """One object's compare-and-swap operations (see the module docstring)."""

    atomic = True

    def create(self, data: bytes) -> str | None:
        """The new token, or None when the object exists."""
        raise NotImplementedError

    def read(self) -> Versioned | None:
        raise NotImplementedError

    def replace(self, data: bytes, token: str) -> str | None:
        """The new token, or None when the object changed since `token` (or is gone)."""
        raise NotImplementedError

    def delete(self, token: str) -> bool:
        """Whether it was deleted (False when it changed since `token` or is gone)."""
        raise NotImplementedError


def conditional_object(url: str, storage_options: dict | None = None) -> ConditionalObject:
    if io.is_local(url):
        return _Local(os.path.abspath(io.local_path(url)))
    fs, path = io.filesystem(url, storage_options)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocols or "s3a" in protocols:
        return _S3(fs, path)
    if "gs" in protocols or "gcs" in protocols:
        return _GCS(fs, path)
    return _BestEffort(fs, path, url)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _precondition_failed(exc: BaseException) -> bool:
    """s3fs and gcsfs turn HTTP 412 (and S3's 409 ConditionalRequestConflict, a concurrent
    conditional write) into FileExistsError or an OSError naming the precondition."""
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__ or exc.__context__
    code = ""
    response = getattr(cause, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
    text = f"{exc} {code}".lower()
    return any(s in text for s in ("precondition", "pre-condition", "412",
                                   "conditionalrequestconflict"))


class _Local(ConditionalObject):
    def __init__(self, path: str):
        self.path = path

    def create(self, data: bytes) -> str | None:
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(self.path)}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        finally:
            os.remove(tmp)
        io.fsync_dir(folder)
        return _sha(data)

    def _locked(self) -> int | None:
        """An fd of the file now at the path, flock'ed exclusively; None when there is none.
        (The file may be removed between open and lock: then try again.)"""
        while True:
            try:  # a link at the lease's name is refused, never written through
                fd = io.open_no_follow(self.path, os.O_RDWR)
            except FileNotFoundError:
                return None
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    @staticmethod
    def _content(fd: int) -> bytes:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)

    def read(self) -> Versioned | None:
        fd = self._locked()
        if fd is None:
            return None
        try:
            data = self._content(fd)
        finally:
            os.close(fd)
        return Versioned(data, _sha(data))

    def replace(self, data: bytes, token: str) -> str | None:
        fd = self._locked()
        if fd is None:
            return None
        try:
            if _sha(self._content(fd)) != token:
                return None
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return _sha(data)

    def delete(self, token: str) -> bool:
        fd = self._locked()
        if fd is None:
            return False
        try:
            if _sha(self._content(fd)) != token:
                return False
            os.remove(self.path)
            return True
        finally:
            os.close(fd)


def _guarded(call, fs: Any, path: str, *, gone_is_lost: bool):
    """call() under a store precondition: None where the precondition failed (or, with
    gone_is_lost, where the object is gone); the store's cached listing of `path` is dropped
    either way."""
    try:
        return call()
    except FileNotFoundError:
        if gone_is_lost:
            return None
        raise
    except OSError as exc:
        if _precondition_failed(exc):
            return None
        raise
    finally:
        fs.invalidate_cache(path)


class _S3(ConditionalObject):
    def __init__(self, fs: Any, path: str):
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.path = f"{self.bucket}/{self.key}"

    def _put(self, data: bytes, gone_is_lost: bool = False, **condition: str) -> str | None:
        out = _guarded(lambda: self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key,
                                               Body=data, **condition),
                       self.fs, self.path, gone_is_lost=gone_is_lost)
        return None if out is None else out["ETag"]

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def read(self) -> Versioned | None:
        from fsspec.asyn import sync

        async def get() -> Versioned:  # the body streams on s3fs's event loop
            out = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with out["Body"] as stream:
                return Versioned(await stream.read(), out["ETag"])
        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None

    def replace(self, data: bytes, token: str) -> str | None:
        return self._put(data, gone_is_lost=True, IfMatch=token)

    def delete(self, token: str) -> bool:
        return _guarded(lambda: self.fs.call_s3("delete_object", Bucket=self.bucket,
                                                Key=self.key, IfMatch=token) or True,
                        self.fs, self.path, gone_is_lost=True) is not None


class _GCS(ConditionalObject):
    """gcsfs's JSON API calls with generation preconditions (gcsfs turns a 412 into
    FileExistsError)."""

    def __init__(self, fs: Any, path: str):
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)

    def _upload(self, data: bytes, generation: str) -> str | None:
        out = _guarded(lambda: self.fs.call(
            "POST", f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
            uploadType="media", name=self.key, ifGenerationMatch=generation,
            headers={"Content-Type": "application/json"}, data=data, json_out=True),
            self.fs, self.path, gone_is_lost=False)
        return None if out is None else str(out["generation"])

    def create(self, data: bytes) -> str | None:
        return self._upload(data, "0")

    def read(self) -> Versioned | None:
        self.fs.invalidate_cache(self.path)
        try:
            generation = str(self.fs.info(self.path)["generation"])
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        # Replaced between the two calls: the generation is older than the data, so a
        # replace with it fails (the safe side).
        return Versioned(data, generation)

    def replace(self, data: bytes, token: str) -> str | None:
        return self._upload(data, token)

    def delete(self, token: str) -> bool:
        return _guarded(lambda: self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key,
                                             ifGenerationMatch=token) or True,
                        self.fs, self.path, gone_is_lost=True) is not None


class _BestEffort(ConditionalObject):
    """A store without conditional writes: check, write, read back. Two writers within the
    same moment can both believe they won."""

    atomic = False
    _warned: set[str] = set()

    def __init__(self, fs: Any, path: str, url: str):
        self.fs, self.path = fs, path
        protocol = io.protocol(url) or "file"
        if protocol not in self._warned:
            self._warned.add(protocol)
            log.warning("%s:// has no conditional writes: the lease on the output is best "
                        "effort there (two runs started at the same moment may both write)",
                        protocol)

    def read(self) -> Versioned | None:
        self.fs.invalidate_cache(self.path)
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        return Versioned(data, _sha(data))

    def _write_checked(self, data: bytes) -> str | None:
        self.fs.pipe_file(self.path, data)
        now = self.read()
        return now.token if now is not None and now.data == data else None

    def create(self, data: bytes) -> str | None:
        if self.read() is not None:
            return None
        return self._write_checked(data)

    def replace(self, data: bytes, token: str) -> str | None:
        now = self.read()
        if now is None or now.token != token:
            return None
        return self._write_checked(data)

    def delete(self, token: str) -> bool:
        now = self.read()
        if now is None or now.token != token:
            return False
        self.fs.rm_file(self.path)
        return True
