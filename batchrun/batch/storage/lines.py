"""What the input readers (readers.py for JSONL, parquet.py for Parquet) hand the job: the
sources of a job, its request lines and their positions. Imports no reader, so both can."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from batchrun.batch.storage.formats import Format
from batchrun.openai.wire import RequestError

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
    digest: int = 0  # of the line's bytes as read: a resumed run notices a line that changed

    @property
    def position(self) -> int:
        return position(self.source, self.line)


class InputReadError(Exception):
    """An input that cannot be read to its end (a truncated or corrupt compressed file, a
    connection lost mid-file). Raised after every complete line before the damage was read."""


def line_digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def position(source: int, line: int) -> int:
    """One sortable int per input line of a job: input order across several files."""
    return (source << _LINE_BITS) | line


def split_position(pos: int) -> tuple[int, int]:
    return pos >> _LINE_BITS, pos & ((1 << _LINE_BITS) - 1)
