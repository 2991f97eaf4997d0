"""Parquet in and out, a row group at a time.

Input is either the OpenAI batch columns (`custom_id`, `method`, `url`, `body` as a JSON string or
a struct) or a flat table: `custom_id` + `messages` (JSON string or list of structs) or `prompt`
(+ optional `system`, + optional `image`: the image's bytes or a URL, or a list of them, shown
after the prompt text), + optional sampling columns named like the request fields
(`max_tokens`, `temperature`, ...). `--column FIELD=COLUMN` maps differently named columns.
Either way each row becomes the JSON text of one batch line, so it is validated exactly like a
JSONL line. Output is one row per result with flat columns for the usual questions and the whole
body as JSON.
"""

from __future__ import annotations

import base64
import io as _io
import json
from json import JSONDecodeError
from typing import IO, Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.batch.storage import io
from batchrun.batch.storage.store import Storage
from batchrun.batch.storage.lines import InputLine, Source, line_digest
from batchrun.openai.wire import RequestError, json_error_message, loads
from batchrun.openai.requests import ChatCompletionRequest
from batchrun.openai.bodies import line_error

_LINE_FIELDS = ("custom_id", "method", "url", "body")
_FLAT_FIELDS = ("messages", "prompt", "system", "image")
_READ_BATCH_ROWS = 512


def request_fields() -> tuple[str, ...]:
    """Column names a table may use: batch columns, flat columns and body fields."""
    body = tuple(f for f in ChatCompletionRequest.model_fields if f != "messages")
    return _LINE_FIELDS + _FLAT_FIELDS + body


def resolve_columns(path: str, names: list[str], columns: dict[str, str]) -> dict[str, str]:
    """field -> column name: the user's --column mappings, then same-named columns."""
    known = request_fields()
    mapping: dict[str, str] = {}
    for field, column in columns.items():
        if field not in known:
            raise ValueError(f"--column {field}={column}: {field!r} is not a request field "
                             f"(one of: {', '.join(known)})")
        if column not in names:
            raise ValueError(f"--column {field}={column}: {path} has no column {column!r} "
                             f"(it has: {', '.join(names)})")
        mapping[field] = column
    for field in known:
        if field not in mapping and field in names and field not in mapping.values():
            mapping[field] = field
    if "custom_id" not in mapping:
        raise ValueError(f"{path}: no custom_id column; map one with --column custom_id=NAME")
    if "body" not in mapping and "messages" not in mapping and "prompt" not in mapping:
        raise ValueError(f"{path}: needs a body column (OpenAI batch columns) or a messages or "
                         f"prompt column (a flat table); map one with --column messages=NAME")
    return mapping


def _drop_nulls(value: Any) -> Any:
    """A struct column has every field in every row; absent fields come back as None."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _json_field(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            return loads(value)
        except JSONDecodeError as exc:
            raise RequestError(f"{field}: {json_error_message(exc)}",
                               code="invalid_json", param=field) from None
    return _drop_nulls(value)


def image_parts(cell: Any) -> list[dict[str, Any]]:
    """An image column's cell (bytes, a URL, or a list of either) as image_url parts; bytes
    become a data: URL (the decoder reads the format from the data, not the media type)."""
    parts = []
    for value in cell if isinstance(cell, list) else [cell]:
        if isinstance(value, (bytes, bytearray)):
            value = "data:application/octet-stream;base64," + base64.b64encode(value).decode()
        if not isinstance(value, str):
            raise RequestError(f"image: a cell must hold image bytes or a URL, got "
                               f"{type(value).__name__}", code="invalid_type", param="image")
        parts.append({"type": "image_url", "image_url": {"url": value}})
    return parts


def row_to_line(row: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """One table row -> an OpenAI batch line (dict). Raises RequestError for an unreadable cell."""
    get = {field: row[column] for field, column in mapping.items()}
    custom_id = get["custom_id"]
    if isinstance(custom_id, int) and not isinstance(custom_id, bool):
        custom_id = str(custom_id)
    if "body" in get:
        body = _json_field(get["body"], "body")
    else:
        if get.get("messages") is not None:
            messages = _json_field(get["messages"], "messages")
        else:
            content = get.get("prompt")
            if get.get("image") is not None:
                content = [{"type": "text", "text": content}] + image_parts(get["image"])
            messages = [{"role": "user", "content": content}]
            if get.get("system") is not None:
                messages.insert(0, {"role": "system", "content": get["system"]})
        body = {"messages": messages}
        for field, value in get.items():
            if field not in _LINE_FIELDS + _FLAT_FIELDS and value is not None:
                body[field] = _drop_nulls(value)
    return {"custom_id": custom_id, "method": get.get("method", "POST"),
            "url": get.get("url", "/v1/chat/completions"), "body": body}


def row_text(row: dict[str, Any], mapping: dict[str, str]) -> str:
    """One table row -> the JSON text of its batch line (what a JSONL file would hold), so it is
    validated like a JSONL line. Raises RequestError for an unreadable cell."""
    return json.dumps(row_to_line(row, mapping), ensure_ascii=False, default=str)


def row_custom_id(row: dict[str, Any], mapping: dict[str, str]) -> str | None:
    """The row's custom_id when it is a string (for the error of a row that did not convert)."""
    cid = row.get(mapping["custom_id"])
    return cid if isinstance(cid, str) else None


def _seekable(f: IO[bytes]) -> IO[bytes]:
    """Parquet needs random access; stdin is read into memory (the one non-streaming case)."""
    try:
        if f.seekable():
            return f
    except (AttributeError, ValueError):
        pass
    return _io.BytesIO(f.read())


def read_parquet(source: Source, storage: Storage,
                 columns: dict[str, str]) -> Iterator[InputLine]:
    with storage.open_read(source.path) as raw:
        pf = pq.ParquetFile(_seekable(raw))
        mapping = resolve_columns(source.path, pf.schema_arrow.names, columns)
        wanted = sorted(set(mapping.values()))
        number = 0
        for batch in pf.iter_batches(batch_size=_READ_BATCH_ROWS, columns=wanted):
            for row in batch.to_pylist():
                number += 1
                try:
                    text = row_text(row, mapping)
                except RequestError as exc:
                    yield InputLine(source.index, number, None, exc, row_custom_id(row, mapping),
                                    line_digest(repr(row).encode()))
                    continue
                yield InputLine(source.index, number, text, digest=line_digest(text.encode()))


def check_schema(source: Source, storage: Storage, columns: dict[str, str]) -> None:
    with storage.open_read(source.path) as raw:
        resolve_columns(source.path, pq.ParquetFile(raw).schema_arrow.names, columns)


def count_rows(source: Source, storage: Storage) -> int | None:
    if source.path == io.STDIO:
        return None
    with storage.open_read(source.path) as raw:
        return pq.ParquetFile(raw).metadata.num_rows


RESULT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("custom_id", pa.string()),
    ("status_code", pa.int32()),
    ("content", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("total_tokens", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("body", pa.string()),  # the whole chat.completion (or error body) as JSON
    # The line's error as JSON ({code, message, param, ...}: its HTTP error body's, or the batch
    # error of a line with no HTTP answer), null for a result.
    ("error", pa.string()),
])


def result_row(record: dict[str, Any]) -> dict[str, Any]:
    response = record.get("response") or {}
    body = response.get("body")
    choices = (body or {}).get("choices") or [{}]
    usage = (body or {}).get("usage") or {}
    error = line_error(record)
    return {
        "id": record.get("id"),
        "custom_id": record.get("custom_id"),
        "status_code": response.get("status_code"),
        "content": (choices[0].get("message") or {}).get("content"),
        "finish_reason": choices[0].get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "total_tokens": usage.get("total_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "body": json.dumps(body, ensure_ascii=False) if body is not None else None,
        "error": json.dumps(error, ensure_ascii=False) if error is not None else None,
    }


class ParquetRecordWriter:
    """Batch output/error records -> Parquet rows, flushed a row group at a time."""

    def __init__(self, raw: IO[bytes], row_group_rows: int = 4096):
        self._writer = pq.ParquetWriter(raw, RESULT_SCHEMA, compression="zstd")
        self._rows: list[dict[str, Any]] = []
        self._group = row_group_rows

    def write_record(self, text: str) -> None:
        self._rows.append(result_row(json.loads(text)))
        if len(self._rows) >= self._group:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=RESULT_SCHEMA))
            self._rows = []

    def close(self) -> None:
        self._flush()
        self._writer.close()
