"""Final output files: JSONL (optionally compressed) or Parquet, appearing whole or not at all.

Locally the file is written beside its target, fsynced and renamed into place; on an object
store the object only exists once the upload completes; `-` streams to stdout.
"""

from __future__ import annotations

from typing import IO

from batchrun.batch.storage import io
from batchrun.batch.storage.formats import Format, compress
from batchrun.batch.storage.store import Storage


class RecordSink:
    """Takes batch records as JSON text (no newline) in order; commit() publishes the file."""

    def __init__(self, path: str, fmt: Format, storage: Storage | dict | None = None):
        """`storage`: the job's Storage; a plain storage-options dict (or None) is taken too
        until every caller passes a Storage."""
        storage = storage if isinstance(storage, Storage) else Storage(storage)
        self.path, self.format = path, fmt
        self.count = 0
        self._local: io.AtomicLocalFile | None = None
        if path == io.STDIO:
            self._raw: IO[bytes] = io.stdout()
        elif io.is_local(path):
            self._local = io.atomic_local_file(io.local_path(path))
            self._raw = self._local.file
        else:
            fs, p = storage.filesystem(path)
            self._raw = fs.open(p, "wb")
        if fmt.kind == "parquet":
            from batchrun.batch.storage.parquet import ParquetRecordWriter

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
        try:
            if self._parquet is not None:
                self._parquet.close()
            elif self._stream is not self._raw:
                self._stream.close()
        except BaseException:  # the codec's last block or the footer failed: no partial file
            self.abort()
            raise
        if self._local is not None:
            self._local.commit()  # discards its temp file itself when the rename fails
        else:
            self._raw.close()

    def abort(self) -> None:
        """Leave no partial file behind (the previous one, if any, stays as it was)."""
        if self._local is not None:
            self._local.discard()
        elif self.path != io.STDIO:
            discard = getattr(self._raw, "discard", None)
            if discard is not None:
                discard()
