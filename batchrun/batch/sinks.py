"""Final output files: JSONL (optionally compressed) or Parquet, appearing whole or not at all.

Locally the file is written beside its target, fsynced and renamed into place; on an object
store the object only exists once the upload completes; `-` streams to stdout.
"""

from __future__ import annotations

import os
from typing import IO

from batchrun.batch import io
from batchrun.batch.formats import Format, compress


class RecordSink:
    """Takes batch records as JSON text (no newline) in order; commit() publishes the file."""

    def __init__(self, path: str, fmt: Format, storage_options: dict | None = None):
        self.path, self.format = path, fmt
        self.count = 0
        self._tmp: str | None = None
        if path == io.STDIO:
            self._raw: IO[bytes] = io.stdout()
        elif io.is_local(path):
            target = io.local_path(path)
            folder = os.path.dirname(os.path.abspath(target))
            os.makedirs(folder, exist_ok=True)
            self._tmp = os.path.join(folder, f".{os.path.basename(target)}.{os.getpid()}.tmp")
            self._raw = open(self._tmp, "wb")
        else:
            fs, p = io.filesystem(path, storage_options)
            self._raw = fs.open(p, "wb")
        if fmt.kind == "parquet":
            from batchrun.batch.parquet import ParquetRecordWriter

            self._parquet: ParquetRecordWriter | None = ParquetRecordWriter(self._raw)
            self._stream: IO[bytes] = self._raw
        else:
            self._parquet = None
            self._stream = compress(self._raw, fmt.compression)

    def write(self, text: str) -> None:
        if self._parquet is not None:
            self._parquet.write_record(text)
        else:
            self._stream.write(text.encode("utf-8") + b"\n")
        self.count += 1

    def commit(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
        elif self._stream is not self._raw:
            self._stream.close()
        if self._tmp is not None:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            target = io.local_path(self.path)
            os.replace(self._tmp, target)
            io.fsync_dir(os.path.dirname(os.path.abspath(target)))
        else:
            self._raw.close()

    def abort(self) -> None:
        """Leave no partial file behind (the previous one, if any, stays as it was)."""
        if self._tmp is not None:
            try:
                self._raw.close()
            except OSError:  # the disk that failed the write may fail the flush on close too
                pass
            if os.path.exists(self._tmp):
                os.remove(self._tmp)
        elif self.path != io.STDIO:
            discard = getattr(self._raw, "discard", None)
            if discard is not None:
                discard()
