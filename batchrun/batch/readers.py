"""Input files -> a stream of request lines, one file after another, never the whole file in memory."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Iterator

from batchrun.batch import io
from batchrun.batch.formats import Format, check_available, decompress, detect
from batchrun.openai.protocol import RequestError

_LINE_BITS = 40  # a position is (source index << 40) | line number


@dataclass(frozen=True)
class Source:
    index: int
    path: str
    format: Format


@dataclass(slots=True)
class InputLine:
    source: int
    line: int  # 1-based line (JSONL) or row (Parquet) number within its file
    text: str | None  # the OpenAI batch line as JSON text; None when `problem` says why not
    problem: RequestError | None = None
    custom_id: str | None = None  # with a problem, when the custom_id could still be read

    @property
    def position(self) -> int:
        return position(self.source, self.line)


def position(source: int, line: int) -> int:
    """One sortable int per input line of a job: input order across several files."""
    return (source << _LINE_BITS) | line


def split_position(pos: int) -> tuple[int, int]:
    return pos >> _LINE_BITS, pos & ((1 << _LINE_BITS) - 1)


def open_sources(args: list[str], storage_options: dict | None = None,
                 input_format: str | None = None) -> list[Source]:
    """Expand the input arguments (files, folders, globs, `-`) into the job's ordered sources.
    Raises FileNotFoundError or ValueError (usage errors)."""
    paths = io.expand_inputs(args, storage_options)
    if paths.count(io.STDIO) > 1:
        raise ValueError("stdin (-) can be read only once")
    sources = []
    for i, path in enumerate(paths):
        fmt = detect(path, input_format)
        check_available(fmt)
        sources.append(Source(i, path, fmt))
    return sources


def check_sources(sources: list[Source], storage_options: dict | None = None,
                  columns: dict[str, str] | None = None) -> None:
    """Fail early (ValueError) on a Parquet input whose columns cannot make requests."""
    for source in sources:
        if source.format.kind == "parquet" and source.path != io.STDIO:
            from batchrun.batch.parquet import check_schema

            check_schema(source, storage_options, columns or {})


def read_source(source: Source, storage_options: dict | None = None,
                columns: dict[str, str] | None = None) -> Iterator[InputLine]:
    if source.format.kind == "parquet":
        from batchrun.batch.parquet import read_parquet

        yield from read_parquet(source, storage_options, columns or {})
    else:
        yield from read_jsonl(source, storage_options)


def read_all(sources: list[Source], storage_options: dict | None = None,
             columns: dict[str, str] | None = None) -> Iterator[InputLine]:
    for source in sources:
        yield from read_source(source, storage_options, columns)


def read_jsonl(source: Source, storage_options: dict | None = None) -> Iterator[InputLine]:
    """Each non-blank line; bytes that are not UTF-8 make that line a problem, not the file."""
    with io.open_read(source.path, storage_options) as raw:
        stream = decompress(raw, source.format.compression)
        try:
            for number, data in enumerate(stream, start=1):
                if number == 1 and data.startswith(codecs.BOM_UTF8):
                    data = data[len(codecs.BOM_UTF8):]
                if not data.strip():
                    continue
                try:
                    yield InputLine(source.index, number, data.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    yield InputLine(source.index, number, None, RequestError(
                        f"the line is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start})", code="invalid_encoding"))
        finally:
            if stream is not raw:
                stream.close()


def count_records(sources: list[Source], storage_options: dict | None = None) -> int | None:
    """Lines/rows of the whole job where that is cheap to know (local plain JSONL, Parquet
    metadata), else None."""
    total = 0
    for source in sources:
        if source.format.kind == "parquet":
            from batchrun.batch.parquet import count_rows

            n = count_rows(source, storage_options)
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
