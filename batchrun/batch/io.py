"""Streaming JSONL readers and writers, local or any fsspec URL; `.gz` handled by extension."""

from __future__ import annotations

import json
from typing import IO, Iterator

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

_EXTENSIONS = (".gz", ".jsonl", ".json")


def is_local(path: str) -> bool:
    return isinstance(url_to_fs(path)[0], LocalFileSystem)


def _write_options(path: str) -> dict:
    return {"auto_mkdir": True} if is_local(path) else {}


def exists(path: str) -> bool:
    fs, p = url_to_fs(path)
    return fs.exists(p)


def iter_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for each non-blank line, read as a stream."""
    with fsspec.open(path, "rt", compression="infer", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def count_lines(path: str) -> int | None:
    """Number of non-blank lines of a local uncompressed file (for a progress total), else None."""
    if not is_local(path) or path.endswith(".gz"):
        return None
    with fsspec.open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def sibling_path(path: str, suffix: str) -> str:
    """`out.jsonl` + `.errors.jsonl` -> `out.errors.jsonl` (also for `out.jsonl.gz`, URLs)."""
    stem = path
    for ext in _EXTENSIONS:
        stem = stem.removesuffix(ext)
    return stem + suffix


class JsonlWriter:
    """Writes one JSON object per line; flush() pushes what was written so far."""

    def __init__(self, path: str):
        self.path = path
        self._file: IO[str] = fsspec.open(path, "wt", compression="infer", encoding="utf-8",
                                          **_write_options(path)).open()
        self.count = 0

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_json(path: str, obj: dict) -> None:
    with fsspec.open(path, "wt", encoding="utf-8", **_write_options(path)) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
