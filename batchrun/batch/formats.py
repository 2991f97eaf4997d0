"""File formats by extension (or `--input-format`/`--output-format`) and stream compression."""

from __future__ import annotations

import bz2
import gzip
import io as _io
import lzma
import typing
import zlib
from dataclasses import dataclass
from typing import IO

from batchrun.batch.io import STDIO
from batchrun.options.job import FormatName

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "xz"}
_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
          ".pq": "parquet"}
# What a decompressor (or the stream under it) raises on truncated or corrupt data.
_STREAM_ERRORS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, lzma.LZMAError)
FORMAT_NAMES: tuple[str, ...] = typing.get_args(FormatName)


@dataclass(frozen=True)
class Format:
    kind: str  # "jsonl" | "parquet"
    compression: str | None = None  # for jsonl: gzip | zstd | bz2 | xz

    def __str__(self) -> str:
        ext = {v: k for k, v in _COMPRESSIONS.items()}.get(self.compression, "")
        return self.kind + ext


def parse_format(name: str) -> Format:
    name = name.strip().lower().lstrip(".")
    if name not in FORMAT_NAMES:
        raise ValueError(f"unknown format {name!r} (use one of: {', '.join(FORMAT_NAMES)})")
    kind, _, comp = name.partition(".")
    return Format(kind, _COMPRESSIONS.get("." + comp) if comp else None)


def detect(path: str, override: str | None = None) -> Format:
    """The format named by `override`, else by the extension; JSONL when nothing says."""
    if override:
        return parse_format(override)
    if path == STDIO:
        return Format("jsonl")
    name = path.lower().rsplit("/", 1)[-1].split("?", 1)[0]
    compression = None
    for ext, comp in _COMPRESSIONS.items():
        if name.endswith(ext):
            compression, name = comp, name[: -len(ext)]
            break
    for ext, kind in _KINDS.items():
        if name.endswith(ext):
            if kind == "parquet" and compression:
                raise ValueError(f"{path}: Parquet compresses internally; drop the {ext} suffix")
            return Format(kind, compression)
    return Format("jsonl", compression)


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ValueError("zstd files need the `zstandard` package: pip install zstandard") from None
    return zstandard


def stream_errors(compression: str | None) -> tuple[type[BaseException], ...]:
    """What reading a stream of this compression raises when its data is cut short or corrupt."""
    if compression == "zstd":
        return _STREAM_ERRORS + (_zstd().ZstdError,)
    return _STREAM_ERRORS


def check_available(fmt: Format) -> None:
    """Raise ValueError (a usage error) for a codec that is not installed."""
    if fmt.compression == "zstd":
        _zstd()


def decompress(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    if compression is None:
        return raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "bz2":
        return bz2.BZ2File(raw, mode="rb")
    if compression == "xz":
        return lzma.LZMAFile(raw, mode="rb")
    if compression == "zstd":
        reader = _zstd().ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return _io.BufferedReader(reader, buffer_size=1 << 20)
    raise ValueError(f"unknown compression {compression!r}")


def compress(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A writer over `raw`; closing it finishes the stream but leaves `raw` open."""
    if compression is None:
        return raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6)
    if compression == "bz2":
        return _Finisher(raw, bz2.BZ2Compressor())
    if compression == "xz":
        return _Finisher(raw, lzma.LZMACompressor())
    if compression == "zstd":
        return _zstd().ZstdCompressor(level=3).stream_writer(raw, closefd=False)
    raise ValueError(f"unknown compression {compression!r}")


class _Finisher:
    def __init__(self, raw: IO[bytes], compressor):
        self._raw, self._c = raw, compressor

    def write(self, data: bytes) -> int:
        self._raw.write(self._c.compress(data))
        return len(data)

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self._raw.write(self._c.flush())
