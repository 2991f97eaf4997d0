"""File formats by extension (or `--input-format`/`--output-format`) and stream compression."""

from __future__ import annotations

import io as _io
import lzma
import typing
import zlib
from dataclasses import dataclass
from typing import IO

from fsspec.compression import compr

from batchrun.batch.storage.io import STDIO
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
        ext = {v: k for k, v in _COMPRESSIONS.items()}.get(self.compression or "", "")
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


# gzip, bz2 and xz are fsspec's codecs (what `fsspec.open(..., compression=)` uses), applied to
# the already-open stream so stdin and local files go the same way as object stores; they are
# the stdlib's GzipFile/BZ2File/LZMAFile, so truncated or corrupt data raises as before. zstd
# stays ours: fsspec's codec is backports.zstd where that is installed and zstandard otherwise
# (other error types, and other multi-frame behaviour: we ask zstandard to read across frames,
# which zstd -T and pzstd files need), its writer closes the stream under it (the local sink
# fsyncs that stream after the codec finishes) and it compresses at level 10 where we use 3.
# zstandard's stream reader ends quietly where a .zst file is cut short: _ZstdFrames reads
# frame by frame and raises EOFError there.
_FSSPEC_CODECS = ("gzip", "bz2", "xz")
# gzip's level 6 (zlib's own default): GzipFile's default 9 compressed JSONL output about 9x
# slower for 8% less. fsspec hands gzip to python-isal instead when that is installed; ISA-L
# takes levels 0-3, so it gets its own (2: 3 compresses no better).
_GZIP_LEVEL = 2 if getattr(compr.get("gzip"), "__name__", "") == "isal" else 6


def decompress(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A reader of the decompressed bytes of `raw`; it raises one of stream_errors() on data
    that is cut short or corrupt."""
    if compression is None:
        return raw
    if compression in _FSSPEC_CODECS:
        return compr[compression](raw, mode="rb")
    if compression == "zstd":
        return _io.BufferedReader(_ZstdFrames(raw), buffer_size=1 << 20)
    raise ValueError(f"unknown compression {compression!r}")


class _ZstdFrames(_io.RawIOBase):
    """Every frame of a zstd stream, one after another (zstd -T and pzstd write several), and
    EOFError where the stream ends inside a frame: zstandard's own stream_reader returns what it
    has and stops quietly at a truncated file."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._zstd = _zstd()
        self._frame = self._zstd.ZstdDecompressor().decompressobj()
        self._started = False  # bytes of the current frame were fed
        self._out = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._started:
                    raise EOFError("the zstd stream ends inside a frame (the file is cut short)")
                return 0
            self._feed(chunk)
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _feed(self, data: bytes) -> None:
        while data:
            self._started = True
            self._out += self._frame.decompress(data)
            if not self._frame.eof:
                return
            data = self._frame.unused_data
            self._frame = self._zstd.ZstdDecompressor().decompressobj()
            self._started = False


def compress(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A writer over `raw`; closing it finishes the stream but leaves `raw` open."""
    if compression is None:
        return raw
    if compression == "gzip":
        return compr["gzip"](raw, mode="wb", compresslevel=_GZIP_LEVEL)
    if compression in _FSSPEC_CODECS:  # bz2 level 9, xz preset 6: the codecs' defaults
        return compr[compression](raw, mode="wb")
    if compression == "zstd":
        return _zstd().ZstdCompressor(level=3).stream_writer(raw, closefd=False)
    raise ValueError(f"unknown compression {compression!r}")
