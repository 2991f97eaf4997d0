"""Input files -> a stream of request lines, one file after another, never the whole file in memory.

The line types (Source, InputLine, InputReadError, positions) are in batch/lines.py."""

from __future__ import annotations

import codecs
import re
from typing import Iterator

from batchrun.batch.storage import io
from batchrun.batch.storage.store import NO_OPTIONS, Storage
from batchrun.batch.storage.formats import check_available, decompress, detect, stream_errors
from batchrun.batch.storage.lines import InputLine, InputReadError, Source, line_digest
from batchrun.openai.wire import RequestError, peek_custom_id


def open_sources(args: list[str], storage: Storage = NO_OPTIONS,
                 input_format: str | None = None) -> list[Source]:
    """Expand the input arguments (files, folders, globs, `-`) into the job's ordered sources.
    Raises FileNotFoundError or ValueError (usage errors)."""
    paths = storage.expand(args)
    if paths.count(io.STDIO) > 1:
        raise ValueError("stdin (-) can be read only once")
    sources = []
    for i, path in enumerate(paths):
        fmt = detect(path, input_format)
        check_available(fmt)
        sources.append(Source(i, path, fmt))
    return sources


def check_sources(sources: list[Source], storage: Storage = NO_OPTIONS,
                  columns: dict[str, str] | None = None) -> None:
    """Fail early (ValueError) on a Parquet input whose columns cannot make requests."""
    for source in sources:
        if source.format.kind == "parquet" and source.path != io.STDIO:
            from batchrun.batch.storage.parquet import check_schema

            check_schema(source, storage, columns or {})


def read_source(source: Source, storage: Storage = NO_OPTIONS,
                columns: dict[str, str] | None = None) -> Iterator[InputLine]:
    if source.format.kind == "parquet":
        from batchrun.batch.storage.parquet import read_parquet

        yield from read_parquet(source, storage, columns or {})
    else:
        yield from read_jsonl(source, storage)


def read_all(sources: list[Source], storage: Storage = NO_OPTIONS,
             columns: dict[str, str] | None = None) -> Iterator[InputLine]:
    for source in sources:
        yield from read_source(source, storage, columns)


def read_jsonl(source: Source, storage: Storage = NO_OPTIONS) -> Iterator[InputLine]:
    """Each non-blank line; bytes that are not UTF-8 make that line a problem, not the file.
    A stream that breaks off raises InputReadError after the complete lines before it."""
    with storage.open_read(source.path) as raw:
        stream = decompress(raw, source.format.compression)
        lines = iter(stream)
        broken = stream_errors(source.format.compression)
        number, offset = 0, 0
        try:
            while True:
                try:
                    data = next(lines)
                except StopIteration:
                    return
                except broken as exc:
                    raise InputReadError(_broken(source, number, offset, raw, exc)) from exc
                number += 1
                offset += len(data)
                if number == 1 and data.startswith(codecs.BOM_UTF8):
                    data = data[len(codecs.BOM_UTF8):]
                if data.strip():
                    yield _jsonl_line(source.index, number, data)
        finally:
            if stream is not raw:
                stream.close()


def _jsonl_line(source: int, number: int, data: bytes) -> InputLine:
    digest = line_digest(data)
    try:
        return InputLine(source, number, data.decode("utf-8"), digest=digest)
    except UnicodeDecodeError as exc:
        return InputLine(source, number, None, RequestError(
            f"the line is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start})", code="invalid_encoding"),
            _readable_custom_id(data.decode("utf-8", "replace")), digest)


# A plain custom_id at the start of a line, for a line that is not JSON once decoded.
_CUSTOM_ID = re.compile(r'\s*\{\s*"custom_id"\s*:\s*"([^"\\\x00-\x1f\ufffd]{1,512})"')


def _readable_custom_id(text: str) -> str | None:
    """What can still be read of a line with bytes that are not UTF-8 (shown as U+FFFD)."""
    cid = peek_custom_id(text)
    if cid is None and (found := _CUSTOM_ID.match(text)):
        cid = found.group(1)
    return cid if cid is None or "\ufffd" not in cid else None


def _broken(source: Source, lines: int, offset: int, raw, exc: BaseException) -> str:
    where = f"after byte {offset:,} of its decompressed content" \
        if source.format.compression else f"after byte {offset:,}"
    try:
        where += f" (byte {raw.tell():,} of the file)" if source.format.compression else ""
    except (OSError, ValueError, AttributeError):
        pass
    return (f"{source.path}: the input breaks off {where}, line {lines + 1}: "
            f"{type(exc).__name__}: {exc}. The {lines:,} lines before it were read; fix or "
            "replace the file and rerun with --resume.")


def count_records(sources: list[Source], storage: Storage = NO_OPTIONS) -> int | None:
    """Lines/rows of the whole job where that is cheap to know (local plain JSONL, Parquet
    metadata), else None."""
    total = 0
    for source in sources:
        if source.format.kind == "parquet":
            from batchrun.batch.storage.parquet import count_rows

            n = count_rows(source, storage)
        elif source.format.compression is None and io.is_local(source.path):
            n = _count_local(source.path)
        else:
            n = None
        if n is None:
            return None
        total += n
    return total


def _count_local(path: str) -> int:
    n = 0
    with open(io.local_path(path), "rb") as f:
        for line in f:
            if line.strip():
                n += 1
    return n
