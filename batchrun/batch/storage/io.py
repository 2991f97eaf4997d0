"""Where data lives: local paths, any fsspec URL (s3://, gs://, http(s)://) and `-` for stdin/stdout.

Storage options (`--storage-options` JSON) are either one flat dict, used for every object store
URL (s3://, gs://, ...; not local paths and not http(s)), or a dict keyed by protocol
(`{"s3": {...}, "http": {...}}`) when a job mixes stores.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import uuid
from typing import IO, Any, Iterator, cast

import fsspec
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem

STDIO = "-"
_LOCAL = {None, "file", "local"}
_HTTP = {"http", "https"}
_KNOWN_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "http", "https",
                    "file", "local", "memory", "hf", "ftp", "sftp", "oci", "r2"}
# Extensions a folder or glob input picks up.
INPUT_EXTENSIONS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz", ".ndjson",
                    ".json", ".parquet", ".pq")
_STEM_SUFFIXES = (".gz", ".zst", ".bz2", ".xz", ".jsonl", ".json", ".ndjson", ".parquet", ".pq")


def protocol(url: str) -> str | None:
    return split_protocol(url)[0]


def options_for(url: str, storage_options: dict | None) -> dict:
    """The fsspec keyword arguments for `url` out of the user's storage options."""
    if not storage_options or url == STDIO:
        return {}
    proto = protocol(url)
    if all(key in _KNOWN_PROTOCOLS for key in storage_options):
        return dict(storage_options.get(proto or "file", {}))
    if proto in _LOCAL or proto in _HTTP:
        return {}
    return dict(storage_options)


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return url_to_fs(url, **options_for(url, storage_options))


def is_local(path: str) -> bool:
    return path != STDIO and protocol(path) in _LOCAL


def local_path(path: str) -> str:
    """A plain filesystem path for a local URL (`file:///x` -> `/x`)."""
    return split_protocol(path)[1] if protocol(path) else path


def exists(path: str, storage_options: dict | None = None) -> bool:
    if path == STDIO:
        return True
    fs, p = filesystem(path, storage_options)
    return fs.exists(p)


def size(path: str, storage_options: dict | None = None) -> int | None:
    """Size in bytes where the store tells it (not for stdin, not always for http)."""
    if path == STDIO:
        return None
    try:
        fs, p = filesystem(path, storage_options)
        value = fs.size(p)
    except (OSError, NotImplementedError, ValueError):
        return None
    return int(value) if value is not None else None


def version(path: str, storage_options: dict | None = None) -> str | None:
    """What changes when the file's content changes: mtime locally, the ETag or modification
    time on a store; None where there is nothing (stdin)."""
    if path == STDIO:
        return None
    if is_local(path):
        return str(os.stat(local_path(path)).st_mtime_ns)
    try:
        fs, p = filesystem(path, storage_options)
        info = fs.info(p)
    except (OSError, NotImplementedError, ValueError):
        return None
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated"):
        if info.get(key) is not None:
            return str(info[key])
    return None


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _hidden(path: str) -> bool:
    """Dot files, and anything in a batchrun staging folder."""
    return (path.rstrip("/").rsplit("/", 1)[-1].startswith(".")
            or ".batchrun-staging/" in path)


def _unstrip(fs: fsspec.AbstractFileSystem, original: str, path: str) -> str:
    """fsspec lists paths without their protocol; put it back so later opens hit the same store."""
    if isinstance(fs, LocalFileSystem) and not protocol(original):
        return path
    return fs.unstrip_protocol(path)


def expand_inputs(args: list[str], storage_options: dict | None = None) -> list[str]:
    """Input arguments -> the files of one job: a folder means the batch files inside it (sorted),
    a glob its matches (sorted); `-` is stdin. Raises FileNotFoundError for what matches nothing."""
    out: list[str] = []
    for arg in args:
        if arg == STDIO:
            out.append(arg)
            continue
        fs, p = filesystem(arg, storage_options)
        if protocol(arg) in _HTTP:
            out.append(arg)  # http has no listing worth trusting; the URL is the file
            continue
        if _has_glob(p):  # like a shell glob: hidden files (staging scratch, ...) are left out
            matches = sorted(m for m in fs.glob(p) if not fs.isdir(m) and not _hidden(m))
        elif fs.isdir(p):
            matches = sorted(m for m in fs.find(p) if m.lower().endswith(INPUT_EXTENSIONS)
                             and not _hidden(m))
        elif fs.exists(p):
            matches = [p]
        else:
            raise FileNotFoundError(f"{arg} does not exist")
        if not matches:
            raise FileNotFoundError(f"{arg} matches no input files")
        out.extend(_unstrip(fs, arg, m) for m in matches)
    return out


def open_read(path: str, storage_options: dict | None = None) -> IO[bytes]:
    """A binary, uncompressed-as-stored stream; `-` is stdin."""
    if path == STDIO:
        return _no_close(sys.stdin.buffer)
    if is_local(path):
        return open(local_path(path), "rb")
    fs, p = filesystem(path, storage_options)
    return fs.open(p, "rb")


class _NoClose:
    """stdin/stdout wrapper whose close() leaves the stream open."""

    def __init__(self, stream: IO[bytes]):
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._stream)

    def close(self) -> None:
        self._stream.flush()

    def __enter__(self) -> "_NoClose":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _no_close(stream: IO[bytes]) -> IO[bytes]:
    # _NoClose is an IO by delegation (__getattr__), which a type checker cannot see.
    return cast(IO[bytes], _NoClose(stream))


def stdout() -> IO[bytes]:
    return _no_close(sys.stdout.buffer)


def sibling_path(path: str, suffix: str) -> str:
    """`out.jsonl` + `.errors.jsonl` -> `out.errors.jsonl` (also for `out.jsonl.gz`, URLs)."""
    stem = path
    changed = True
    while changed:
        changed = False
        for ext in _STEM_SUFFIXES:
            if stem.endswith(ext):
                stem, changed = stem[: -len(ext)], True
    return stem + suffix


class LinkRefused(OSError):
    """A file batchrun keeps beside the output (a lease, a staging file) is a symbolic link:
    it is neither followed nor written through (a usage error)."""


def open_no_follow(path: str, flags: int, mode: int = 0o666) -> int:
    """os.open(path, flags) without following a symbolic link at `path`: LinkRefused instead
    (with O_CREAT | O_EXCL a link, even a dangling one, is FileExistsError as for any name)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
    raise LinkRefused(_linked(path))


def refuse_link(path: str) -> None:
    """LinkRefused when `path` itself is a symbolic link (a folder batchrun keeps its files in)."""
    if os.path.islink(path):
        raise LinkRefused(_linked(path))


def _linked(path: str) -> str:
    return (f"{path} is a symbolic link: batchrun does not follow links to the files it keeps "
            "beside its output (remove the link, or write somewhere else)")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicLocalFile:
    """A local file that appears whole or not at all: written to a hidden temp file beside the
    target, then on commit() fsynced, renamed into place and the folder fsynced; discard() (or
    any failure, commit's own included) removes the temp file and leaves the target as it was.

    As a context manager (see atomic_local_file) it gives the binary file, commits when the
    block ends and discards when it raises. The temp name is unique per call (pid and a random
    part), so threads writing one target do not share a temp file; it starts with a dot, which
    input globs and staging listings pass over."""

    def __init__(self, target: str | os.PathLike):
        self.target = os.fspath(target)
        self.folder = os.path.dirname(os.path.abspath(self.target))
        os.makedirs(self.folder, exist_ok=True)
        self.tmp = os.path.join(self.folder, f".{os.path.basename(self.target)}."
                                             f"{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        self.file: IO[bytes] = open(self.tmp, "xb")  # open(), not mkstemp: the umask's mode

    def commit(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.target)
        except BaseException:  # a full disk, say: leave no scratch file behind
            self.discard()
            raise
        fsync_dir(self.folder)

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:  # the disk that failed the write may fail the flush on close too
            pass
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> IO[bytes]:
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def atomic_local_file(target: str | os.PathLike) -> AtomicLocalFile:
    """`with atomic_local_file(path) as f: f.write(...)`: `path` gets all of it or keeps what it
    had (see AtomicLocalFile; the folder is created)."""
    return AtomicLocalFile(target)


def write_bytes_atomic(path: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write a whole file so a reader sees all of it or nothing: fsync + rename locally, one PUT on
    an object store (objects appear only when complete)."""
    if is_local(path):
        with atomic_local_file(local_path(path)) as f:
            f.write(data)
        return
    fs, p = filesystem(path, storage_options)
    fs.pipe_file(p, data)


def remove(path: str, storage_options: dict | None = None) -> None:
    """Delete a file if it is there."""
    if path == STDIO:
        return
    if is_local(path):
        try:
            os.remove(local_path(path))
        except FileNotFoundError:
            pass
        return
    fs, p = filesystem(path, storage_options)
    if fs.exists(p):
        fs.rm(p)


def write_json(path: str, obj: dict, storage_options: dict | None = None) -> None:
    data = (json.dumps(obj, indent=2) + "\n").encode()
    if path == STDIO:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    write_bytes_atomic(path, data, storage_options)


def read_json(path: str, storage_options: dict | None = None) -> Any:
    with open_read(path, storage_options) as f:
        return json.loads(f.read())
