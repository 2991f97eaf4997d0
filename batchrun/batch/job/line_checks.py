"""What every input line is checked for before it reaches the engine (the run and `validate`
alike): its own problems, the request it prepares to, and a custom_id no earlier line used."""

from __future__ import annotations

from typing import Any, Callable

from batchrun.batch.job.idset import IdSet
from batchrun.batch.storage.lines import InputLine
from batchrun.openai.wire import LineError, RequestError, peek_custom_id


def duplicate_error(line: int, custom_id: str) -> LineError:
    return LineError(line, RequestError(
        f"custom_id: {custom_id!r} was already used by an earlier line (custom_ids must be "
        "unique within a batch)", code="duplicate_custom_id", param="custom_id"), custom_id)


def internal_error(item: Any, stage: str, exc: Exception,
                   custom_id: str | None = None) -> LineError:
    """A line that failed on an unexpected exception: a 500 for it (retryable with
    --retry-failed), never the end of the job."""
    if custom_id is None:
        custom_id = getattr(item, "custom_id", None) or peek_custom_id(getattr(item, "text", None))
    return LineError(item.line, RequestError(
        f"internal error while {stage}: {type(exc).__name__}: {exc}", code="internal_error",
        type="server_error", status_code=500), custom_id)


def check_item(item: InputLine, ids: IdSet, prepare: Callable[[str, int], Any]) -> Any:
    """prepare(text, line) plus the duplicate check; raises LineError. The first line with a
    custom_id owns it, valid or not; a later line with the same custom_id is a duplicate."""
    if item.problem is not None:
        if item.custom_id is not None and not ids.add(item.custom_id):
            raise duplicate_error(item.line, item.custom_id)
        raise LineError(item.line, item.problem, item.custom_id)
    assert item.text is not None  # a line without a problem has its text
    try:
        prepared = prepare(item.text, item.line)
    except LineError as exc:
        if exc.custom_id is not None and not ids.add(exc.custom_id):
            raise duplicate_error(item.line, exc.custom_id) from None
        raise
    if not ids.add(prepared.custom_id):
        raise duplicate_error(item.line, prepared.custom_id)
    return prepared
